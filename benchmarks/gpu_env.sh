# Source this on the lent GPU machine, from the project root, after carrying .whl/
# (filled here by `bash ../shared/tools/gpu-wheels.sh`). The image has torch and timm but no mlflow.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed"; exit 1; }
# MLproject commands call `python`; a symlink to a venv's python3 would lose the venv (and torch), so wrap it
mkdir -p /tmp/shim && printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" > /tmp/shim/python && chmod +x /tmp/shim/python
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/shim:/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
# The image's packages have no bytecode, in a folder Python does not write it to: every process compiled ~3,000
# modules of torch and timm from source (9.7 s of a 29 s `vitreg bench`, cProfile, 2026-12-03), which a pip
# install does once. So once here, into a cache of our own, before anything is timed.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=/tmp/pycache
python3 -m compileall -q -j 0 /tmp/site $PWD/vitreg \
  $(python3 -c "import os, torch, torchvision, timm; print(*(os.path.dirname(m.__file__) for m in (torch, torchvision, timm)))") \
  >/dev/null 2>&1 || echo "compileall: some files did not compile (they compile on import)"
export GPU_RUNS=${GPU_RUNS:-$PWD/gpu-runs}
mkdir -p "$GPU_RUNS"
export MLFLOW_TRACKING_URI=sqlite:///$GPU_RUNS/mlflow.db
# keep the artifacts beside the db so one tarball brings the whole store back
export MLFLOW_ARTIFACT_ROOT=$GPU_RUNS/artifacts
python3 - <<'PY'
import mlflow, os
for name in ("h200-bench", "h200-ddp"):
    if mlflow.get_experiment_by_name(name) is None:
        mlflow.create_experiment(name, artifact_location="file://" + os.environ["MLFLOW_ARTIFACT_ROOT"] + "/" + name)
PY
