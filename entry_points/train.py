"""MLproject entry point `train`: `mlflow run . -e train -P model=deit_tiny_patch16_224 -P steps=1000 [-P k=v ...]`.

The same options as `vitreg train`; mlflow run passes each -P through the MLproject command line
(undeclared ones as `--k v`) and MLFLOW_RUN_ID, which the tracking layer resumes.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without install

from interpreter import use_the_python_with_dependencies  # noqa: E402  (beside this script; standard library only)

use_the_python_with_dependencies()  # `mlflow run` starts the python first on PATH: maybe not vitreg's

from vitreg.cli.main import main  # noqa: E402

if __name__ == "__main__":
    main(["train", *sys.argv[1:]], prog_name="entry_points/train.py")
