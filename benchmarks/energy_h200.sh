#!/bin/bash
# Energy per image on one H200: vitreg bench (ViT-B/16 bf16 compiled; infer bs256, then train bs1536) with its
# energy trace recorded (VITREG_ENERGY_TRACE), each beside the plain NVML loop benchmarks/energy_check.py in the
# same call, which must agree within 5 %. Never touches the GPU's clocks or power limit: the power cap it
# shows is the card's own. Run on the device machine from a tree holding vitreg/ and benchmarks/, with the
# mlflow wheels in $WHL (default .whl):  bash benchmarks/energy_h200.sh
# Writes $OUT/log.txt, $OUT/trace-<task>.jsonl (vitreg's readings) and $OUT/samples-<task>.jsonl (the loop's).
set -u
START=$(date +%s); DEADLINE=${DEADLINE:-300}  # seconds after which no new item starts
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ${WHL:-.whl}/*.whl \
  || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MLFLOW_TRACKING_URI=sqlite:////tmp/energy-runs.db
export MLFLOW_EXPERIMENT_NAME=h200-energy
LOG=$OUT/log.txt
say() { echo "[$(( $(date +%s) - START ))s] $*" | tee -a $LOG; }
left() { [ $(( $(date +%s) - START )) -lt $DEADLINE ] || { say "deadline: skipping $*"; return 1; }; }
budget() { local b=$(( ${END:-390} - ($(date +%s) - START) )); echo $(( b < 170 ? b : 170 )); }  # an item's timeout
nvidia-smi --query-gpu=name,driver_version,power.limit,power.max_limit,clocks.sm,clocks.max.sm,temperature.gpu \
  --format=csv | tee -a $LOG
python3 -c "import mlflow; mlflow.create_experiment('h200-energy')" 2>/dev/null
figure() {  # the newest run's <task>_energy_j_per_img and its throttle/contention tags
  python3 - "$1" <<'PY'
import sys, mlflow
task = sys.argv[1]
run = mlflow.search_runs(experiment_names=["h200-energy"], order_by=["start_time DESC"], max_results=1).iloc[0]
keys = [c for c in run.index if c.startswith((f"metrics.{task}_", f"tags.{task}_"))
        and any(k in c for k in ("energy", "power", "per_j", "clock", "capped", "throttle", "busy", "load",
                                 "other", "throughput_img_per_s"))]
print(" ".join(f"{k.split('.', 1)[1]}={run[k]}" for k in sorted(keys)), file=sys.stderr)
print(run[f"metrics.{task}_energy_j_per_img"])
PY
}
one() {  # task batch steps repeats
  local task=$1 bs=$2 steps=$3 repeats=$4
  left "$task" || return
  say "vitreg bench --task $task --batch-size $bs --steps $steps --repeats $repeats"
  VITREG_ENERGY_TRACE=$OUT/trace-$task.jsonl timeout $(budget) python3 -m vitreg.cli bench --gpu h200 \
    --model vit_base_patch16_224 --amp bf16 --compile default --task $task --batch-size $bs --warmup 10 \
    --steps $steps --repeats $repeats 2>&1 | grep -E "window|energy|^(infer|train) |rror" | tee -a $LOG
  local vj; vj=$(figure $task 2>>$LOG); say "vitreg $task J/img: $vj"
  left "independent $task" || return
  say "energy_check --task $task --batch-size $bs --iters $steps --repeats $repeats"
  timeout $(budget) python3 benchmarks/energy_check.py --task $task --batch-size $bs --iters $steps --repeats $repeats \
    --samples $OUT/samples-$task.jsonl ${vj:+--agree $vj} 2>>$OUT/stderr.txt | tee -a $OUT/results.jsonl $LOG
}
one infer 256 200 5
one train 1536 12 3
say "done"
