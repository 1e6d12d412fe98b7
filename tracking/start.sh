#!/usr/bin/env bash
# Start the vitreg MLflow tracking server in the foreground (Ctrl-C stops it).
#
#   bash tracking/start.sh              # settings from the environment / tracking/server.env
#   bash tracking/start.sh --dry-run    # show the configuration and the mlflow command only
#
# Runs from the repository root, so the default data folder is <repo>/vitreg-data. When
# tracking/server.env exists (copy tracking/server.env.example), its values are exported first
# and win over the same variables in your shell. Python: $PYTHON, else the repo's .venv, else
# python3. Everything else is in vitreg/deploy/server.py (`python -m vitreg.deploy.server --help`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ -f tracking/server.env ]; then
    set -a
    # shellcheck disable=SC1091
    . tracking/server.env
    set +a
fi
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
exec "$PYTHON" -m vitreg.deploy.server "$@"
