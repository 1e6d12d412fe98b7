# vitreg: two commands set everything up on a fresh machine.
#   make bench   venv + install + one benchmark logged to the embedded default store (sqlite:///mlflow.db)
#   make test    venv + install + the test suite (the same command CI runs)
# Other targets: make server (tracking server from tracking/), make ui (MLflow UI on ./mlflow.db; UI_STORE=... for
#   another store, as a run's last line names it),
#   make mlproject (MLproject and the README parameter tables, from vitreg/config/options.py).

PYTHON  ?= python3
VENV    ?= .venv
PY      := $(VENV)/bin/python
# torch/torchvision pins: the pair that installs from local disk on the project's machines; any
# torch >= 2.4 works (see pyproject.toml).
TORCH   ?= torch==2.14.1 torchvision==0.29.1
STAMP   := $(VENV)/.vitreg-installed

# Bench parameters (any MLproject param: make bench ARGS="-P model=deit_small_patch16_224 -P compile=default").
# Without a GPU the default is a CPU-sized run (ViT-B/16 at batch 64 would take most of an hour on 2 cores).
# A param given in ARGS replaces the default of the same name (mlflow run refuses a repeated -P).
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
ifeq ($(HAS_GPU),1)
BENCH_DEFAULTS ?= gpu=auto
else
BENCH_DEFAULTS ?= gpu=auto model=deit_tiny_patch16_224 batch_size=8 warmup=3 steps=5 repeats=3
endif
ARGS ?=

.PHONY: install bench test test-fast mlproject server ui clean

install: $(STAMP)

# A line per step, with what each usually takes (an idle 2-core machine, wheels cached): pip's own -q output
# says nothing for minutes, and its progress bars would flood a CI log.
$(STAMP): pyproject.toml
	@echo "[1/3] creating $(VENV) and upgrading pip (about 20 s)"
	@$(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip
	@echo "[2/3] installing $(TORCH) (1-2 min; a first download of the CUDA build is ~3 GB)"
	@$(PY) -m pip install -q $(TORCH)
	@echo "[3/3] installing vitreg with timm, MLflow and the test tools (about 1 min)"
	@$(PY) -m pip install -q -e '.[test,server]' > $(VENV)/pip-install.log 2>&1 || { tail -n 30 $(VENV)/pip-install.log; \
	  echo "error: installing vitreg failed (above; the whole log: $(VENV)/pip-install.log)"; exit 2; }
	@touch $@
	@echo "installed into $(VENV)"

bench: $(STAMP)
	@defaults=""; for kv in $(BENCH_DEFAULTS); do \
	  case " $(ARGS) " in *"-P $${kv%%=*}="*) ;; *) defaults="$$defaults -P $$kv" ;; esac; \
	done; \
	echo "mlflow run . -e bench --env-manager local$$defaults $(ARGS)"; \
	PATH="$(abspath $(VENV))/bin:$$PATH" mlflow run . -e bench --env-manager local $$defaults $(ARGS)

# Two workers (this project's machines have 2 cores); --dist loadfile keeps a module's servers (and the Ray
# cluster and README run of tests/_sessions.py, one per test run) in one worker; --no-loadscope-reorder hands the
# files out in the order tests/_sessions.py sets, longest first, so no worker ends alone on a long file.
PYTEST_ARGS ?= -n 2 --dist loadfile --no-loadscope-reorder

# Python's bytecode cache on for the test runs, whatever PYTHONDONTWRITEBYTECODE the shell sets: each xdist
# worker imports every test module, and pytest rewrites a module's asserts before it imports it (4-7 s of CPU
# per worker, half its collection); it keeps the result in tests/__pycache__ (ignored by git) only where
# bytecode may be written, and a later run reads it back (a first run from a fresh clone still pays it).
test test-fast: export PYTHONDONTWRITEBYTECODE :=

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The fast tier starts no process (tests/conftest.py fails a test that does without @pytest.mark.slow).
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# MLproject and the README's parameter tables, rewritten from the option table (vitreg/config/options.py)
mlproject: $(STAMP)
	$(PY) -m vitreg.config.generate

server: $(STAMP)
	$(PY) -m vitreg.deploy.server

# The MLflow UI on the local store, as lean as vitreg.deploy.server starts a server (no job runner, one
# worker); it first prints each experiment's runs list (MLflow 3's UI opens on its GenAI home).
UI_STORE ?= sqlite:///mlflow.db
UI_PORT  ?= 5000
ui: $(STAMP)
	@$(PY) -c 'import sys; from vitreg.tracking.search import print_experiment_links as links; links(*sys.argv[1:])' \
	  "$(UI_STORE)" "http://127.0.0.1:$(UI_PORT)"
	MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false $(VENV)/bin/mlflow ui --backend-store-uri "$(UI_STORE)" \
	  --host 127.0.0.1 --port $(UI_PORT) --workers 1

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
