"""MLproject entry point `bench`: `mlflow run . -e bench -P gpu=a100 [-P k=v ...]`.

The same options as `vitreg bench`; mlflow run passes each -P as `--k v` (or through the command
line in MLproject) and MLFLOW_RUN_ID, which the tracking layer resumes.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without install

from interpreter import use_the_python_with_dependencies  # noqa: E402  (beside this script; standard library only)

use_the_python_with_dependencies()  # `mlflow run` starts the python first on PATH: maybe not vitreg's

from vitreg.cli.main import main  # noqa: E402

if __name__ == "__main__":
    main(["bench", *sys.argv[1:]], prog_name="entry_points/bench.py")
