#!/bin/bash
# Issue 28 (speed III) points 1-3 on one H200, in one call. From the project root, .whl/ carried:
#   ITEMS="mission agree sweep" bash benchmarks/speed3_h200.sh
# Items, in this order:
#   mission  the mission's command twice (mlflow run . -e bench -P gpu=h200: by default windows of window_min_s=1 s
#            until the median's 95 % interval is within precision_pct=1 %): the wall time of each; the second reuses
#            the batch_size=auto cache. Then once with today's fixed counts (-P steps=30 -P repeats=5): the figures
#            of the adaptive runs must be within 1 % of it
#   agree    vitreg (adaptive, then fixed counts) beside the independent CUDA-event loop (benchmarks/independent_check.py)
#            for ViT-B/16 bf16 batch 512, infer and train: within 1 % in both modes
#   sweep    vitreg sweep --models vit_base_patch16_224 --amp tf32,bf16 --compile off,default --batch-size 32,256
#            --task infer (8 children, warm caches after the mission): its wall time
# At the end a table from the store: per run the figures, timed windows, half-width, stop reason, estimated_work_s
# against work_s (within 25 %?) and overhead_<phase>_s. Writes $OUT/log.txt and $OUT/runs.txt.
# DEADLINE (s, default 540): no item starts after it.
set -u
START=$(date +%s); DEADLINE=${DEADLINE:-540}
ITEMS=" ${ITEMS:-mission agree sweep} "
source benchmarks/gpu_env.sh
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache VITREG_COMPILE_CACHE=/tmp/inductor-cache
export MLFLOW_EXPERIMENT_NAME=h200-bench
LOG=$OUT/log.txt
say() { echo "[$(( $(date +%s) - START ))s] $*" | tee -a $LOG; }
left() { [ $(( $(date +%s) - START )) -lt $DEADLINE ] || { say "deadline: skipping $*"; return 1; }; }
want() { case "$ITEMS" in *" $1 "*) left "item $1" ;; *) return 1 ;; esac; }
timed() {  # name timeout command...: the command's wall time, its results table and warnings in the log
  local name=$1 limit=$2; shift 2; left "$name" || return; say "$name: $*"
  local s=$(date +%s.%N)
  timeout $limit "$@" >$OUT/$name.txt 2>&1
  say "$name: rc=$? wall $(python3 -c "print(round($(date +%s.%N) - $s, 1))") s"
  grep -E '^\[vitreg\] (estimate|overhead)|precision target|^(infer|train) |^warning|^error' $OUT/$name.txt \
    | cut -c1-400 | sed 's/^/    /' | tee -a $LOG
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,power.limit --format=csv,noheader | tee -a $LOG
if want mission; then
  timed mission1 240 mlflow run . -e bench --env-manager local -P gpu=h200
  timed mission2 240 mlflow run . -e bench --env-manager local -P gpu=h200
  timed mission_fixed 240 mlflow run . -e bench --env-manager local -P gpu=h200 -P steps=30 -P repeats=5
fi
if want agree; then
  B="--gpu h200 --model vit_base_patch16_224 --amp bf16 --batch-size 512"
  timed agree_adaptive 150 python3 -m vitreg.cli bench $B
  timed agree_fixed 150 python3 -m vitreg.cli bench $B --warmup 10 --steps 30 --repeats 5
  for t in infer train; do
    left "independent $t" && say "independent_check $t" && timeout 90 python3 benchmarks/independent_check.py \
      --model vit_base_patch16_224 --amp bf16 --batch-size 512 --task $t --warmup 10 --iters 30 --repeats 5 \
      2>/dev/null | tee -a $OUT/independent.jsonl | cut -c1-300 | tee -a $LOG
  done
fi
if want sweep; then
  timed sweep 300 python3 -m vitreg.cli sweep --models vit_base_patch16_224 --amp tf32,bf16 --compile off,default \
    --batch-size 32,256 --task infer
fi
python3 - <<'PY' | tee $OUT/runs.txt | tee -a $LOG
from mlflow.tracking import MlflowClient
c = MlflowClient()
for exp in c.search_experiments():
    for r in c.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"]):
        m, t, p = r.data.metrics, r.data.tags, r.data.params
        if "work_s" not in m:
            continue
        est = m.get("estimated_work_s"); ratio = est / m["work_s"] if est else float("nan")
        print(f"{r.info.run_name}: steps={p.get('steps')} repeats={p.get('repeats')} "
              f"estimate {est:.1f} s / work {m['work_s']:.1f} s = {ratio:.2f}")
        for task in ("infer", "train"):
            if f"{task}_throughput_img_per_s" in m:
                print(f"  {task}: {m[f'{task}_throughput_img_per_s']:,.1f} img/s, {m.get(f'{task}_timed_windows'):.0f} "
                      f"windows x {m.get(f'{task}_steps_per_window'):.0f} steps, +-{m.get(f'{task}_throughput_ci95_halfwidth_pct', float('nan')):.2f} %, "
                      f"stop {t.get(f'{task}_timing_stop')}, cv {m.get(f'{task}_throughput_cv', float('nan')):.2%}")
        print("  overhead: " + ", ".join(f"{k[9:-2]} {v:.2f}" for k, v in sorted(m.items()) if k.startswith("overhead_")))
PY
say "done"
