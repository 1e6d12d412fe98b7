"""MLproject entry point `infer`: `mlflow run . -e infer -P model_uri=models:/NAME@ALIAS [-P k=v ...]`.

The same options as `vitreg infer`; mlflow run passes MLFLOW_RUN_ID, which the tracking layer resumes.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without install

from interpreter import use_the_python_with_dependencies  # noqa: E402  (beside this script; standard library only)

use_the_python_with_dependencies()  # `mlflow run` starts the python first on PATH: maybe not vitreg's

from vitreg.cli.main import main  # noqa: E402

if __name__ == "__main__":
    main(["infer", *sys.argv[1:]], prog_name="entry_points/infer.py")
