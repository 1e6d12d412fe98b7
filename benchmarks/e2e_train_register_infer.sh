#!/bin/bash
# The train -> register -> pull -> infer flow of issue 3, CPU-sized, against a fresh temporary store:
#   1. vitreg train (tiny test_vit, synthetic data, device cpu) registers its last checkpoint as
#      models:/tiny-e2e@champion;
#   2. the loss is read back from the store: it must fall;
#   3. vitreg pull models:/tiny-e2e@champion --out DIR: sha256-verified, rebuilt, forward-checked;
#   4. vitreg infer --model-uri models:/tiny-e2e@champion: a benchmark run linked to the version both ways.
# The same flow as benchmarks/ddp_scaling.sh (b), minutes smaller. From the project root:
#   bash benchmarks/e2e_train_register_infer.sh            (NPROC=2 trains with 2 gloo processes, DDP)
# Exits non-zero if any step fails or any check does not hold. The summary goes to the screen and to
# $OUT/log.txt (OUT defaults to the temporary store folder, kept when a step fails or with KEEP=1).
set -u -o pipefail
START=$(date +%s)
ROOT=$(pwd)
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=${PYTHON:-$ROOT/.venv/bin/python}
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}  # vitreg from this checkout, also after the cd below
NPROC=${NPROC:-1}
WORK=$(mktemp -d /tmp/vitreg-e2e-XXXXXX)
OUT=${OUT:-$WORK}
LOG=$OUT/log.txt
export MLFLOW_TRACKING_URI=sqlite:///$WORK/mlflow.db MLFLOW_DISABLE_TELEMETRY=true PYTHONUNBUFFERED=1
unset MLFLOW_RUN_ID MLFLOW_EXPERIMENT_ID MLFLOW_EXPERIMENT_NAME
say() { echo "[$(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }
fail() { say "FAILED: $*"; say "store and logs kept in $WORK"; exit 1; }
cd "$WORK" || exit 1  # the default experiment's artifacts (./mlruns) land beside the db

say "store $MLFLOW_TRACKING_URI (nproc=$NPROC)"
say "1. train"
$PY -m vitreg.cli train --model test_vit --img-size 32 --num-classes 10 --batch-size 16 --device cpu \
    --steps 60 --log-every 10 --checkpoint-every 30 --lr 2e-3 --warmup-steps 5 --label-smoothing 0 \
    --num-workers 0 --nproc "$NPROC" --register-as tiny-e2e --alias champion --experiment e2e-train \
    >"$WORK/train.out" 2>"$WORK/train.err" || { tail -5 "$WORK/train.err"; fail "train"; }
sed -E 's/^\[rank0\]: //' "$WORK/train.out" | grep -E '^(trained|checkpoint:|logged run)' | tee -a "$LOG"
grep -E 'registered test_vit' "$WORK/train.err" | sed -E 's/^.*\[vitreg\] //' | tee -a "$LOG"
TRAIN_RUN=$(sed -nE 's/^(\[rank0\]: )?logged run ([0-9a-f]+) .*/\2/p' "$WORK/train.out" | tail -1)
[ -n "$TRAIN_RUN" ] || fail "no 'logged run <id>' line from train"

say "2. the loss, read back from the store"
$PY - "$TRAIN_RUN" <<'PY' 2>&1 | tee -a "$LOG" || fail "loss check"
import sys
from mlflow.tracking import MlflowClient
c = MlflowClient()
run = c.get_run(sys.argv[1])
hist = sorted((m.step, m.value) for m in c.get_metric_history(run.info.run_id, "train_loss"))
print("train_loss by step: " + ", ".join(f"{s}:{v:.3f}" for s, v in hist))
first, last = hist[0][1], hist[-1][1]
m = run.data.metrics
print(f"run {run.info.run_id} {run.info.status}: loss {first:.3f} at step {hist[0][0]} -> {last:.3f} at step "
      f"{hist[-1][0]}; {m['train_throughput_img_per_s']:.1f} img/s, world size {int(m.get('train_world_size', 1))}")
assert run.info.status == "FINISHED", run.info.status
assert last < 0.8 * first, f"the loss did not fall: {first:.3f} -> {last:.3f}"
PY

say "3. pull models:/tiny-e2e@champion"
rm -rf /tmp/vitreg-e2e-pulled
$PY -m vitreg.cli pull models:/tiny-e2e@champion --out /tmp/vitreg-e2e-pulled >"$WORK/pull.out" 2>"$WORK/pull.err" \
  || { tail -5 "$WORK/pull.err"; fail "pull"; }
tee -a "$LOG" <"$WORK/pull.out"

say "4. infer --model-uri models:/tiny-e2e@champion"
$PY -m vitreg.cli infer --model-uri models:/tiny-e2e@champion --device cpu --batch-size 8 --warmup 2 --steps 5 \
    --repeats 2 --experiment e2e-infer >"$WORK/infer.out" 2>"$WORK/infer.err" \
  || { tail -5 "$WORK/infer.err"; fail "infer"; }
tee -a "$LOG" <"$WORK/infer.out"
INFER_RUN=$(sed -nE 's/^logged run ([0-9a-f]+) .*/\1/p' "$WORK/infer.out" | tail -1)
[ -n "$INFER_RUN" ] || fail "no 'logged run <id>' line from infer"

say "5. the links: version <- train run, infer run <-> version"
$PY - "$TRAIN_RUN" "$INFER_RUN" <<'PY' 2>&1 | tee -a "$LOG" || fail "links"
import sys
from mlflow.tracking import MlflowClient
train_id, infer_id = sys.argv[1:3]
c = MlflowClient()
mv = c.get_model_version_by_alias("tiny-e2e", "champion")
infer = c.get_run(infer_id)
t = infer.data.tags
print(f"models:/tiny-e2e/{mv.version} (@champion): source run {mv.run_id}, step {mv.tags.get('step')}, "
      f"last_infer_run_id {mv.tags.get('last_infer_run_id')}, "
      f"last_infer_throughput_img_per_s {mv.tags.get('last_infer_throughput_img_per_s')}")
print(f"infer run {infer_id} {infer.info.status}: model_uri {t.get('model_uri')}, registered_model_version "
      f"{t.get('registered_model_name')}/{t.get('registered_model_version')}, source_run_id {t.get('source_run_id')}, "
      f"{infer.data.metrics['infer_throughput_img_per_s']:.1f} img/s")
assert mv.run_id == train_id, (mv.run_id, train_id)
assert mv.tags.get("last_infer_run_id") == infer_id
assert t.get("registered_model_name") == "tiny-e2e" and t.get("registered_model_version") == str(mv.version)
assert t.get("source_run_id") == train_id and infer.info.status == "FINISHED"
print("OK: train -> loss falls -> registered -> pulled -> infer run linked to the version")
PY
say "done in $(( $(date +%s) - START )) s"
cd "$ROOT" || true
[ "${KEEP:-0}" = 1 ] || rm -rf "$WORK"  # the log is on the screen (and in $OUT/log.txt when OUT is set)
