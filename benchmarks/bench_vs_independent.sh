#!/bin/bash
# vitreg vs the independent loop on one H200: vitreg bench (bf16, batch 256; compile off and default) for ViT-B/16 and
# DeiT-Ti/S/B, each next to the independent CUDA-event loop (benchmarks/independent_check.py) for the same
# configuration. Run on the device machine from the project root:  bash benchmarks/bench_vs_independent.sh
# Writes $OUT/log.txt (progress with timestamps), $OUT/independent.jsonl and $OUT/store.tgz (the MLflow
# store: mlflow.db + artifacts). A deadline keeps the whole call inside the device's 10-minute limit.
set -u
START=$(date +%s); DEADLINE=${DEADLINE:-480}  # seconds after which no new item starts
source benchmarks/gpu_env.sh
export MLFLOW_EXPERIMENT_NAME=h200-bench
LOG=$OUT/log.txt
say() { echo "[$(( $(date +%s) - START ))s] $*" | tee -a $LOG; }
left() { [ $(( $(date +%s) - START )) -lt $DEADLINE ] || { say "deadline: skipping $*"; return 1; }; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader | tee -a $LOG
COMMON="--gpu h200 --amp bf16 --batch-size 256 --warmup 10 --steps 20 --repeats 5"
vb() {  # vitreg bench, results table into the log
  left "vitreg $*" || return; say "vitreg bench $COMMON $*"
  timeout ${VB_TIMEOUT:-150} python3 -m vitreg.cli bench $COMMON "$@" 2>$OUT/last_stderr.txt | grep -E '^(infer|train) ' | tee -a $LOG
  grep -E '^error|Error' $OUT/last_stderr.txt | tail -2 | tee -a $LOG
}
ck() {  # independent loop
  left "check $*" || return; say "independent_check --batch-size 256 --warmup 10 --iters 20 --repeats 5 $*"
  timeout ${CK_TIMEOUT:-60} python3 benchmarks/independent_check.py --batch-size 256 --warmup 10 --iters 20 --repeats 5 "$@" \
    2>/dev/null | tee -a $OUT/independent.jsonl | cut -c1-200 | tee -a $LOG
}
# in priority order: the independent-loop agreement first, then the other models, then compile.
# SKIP_DONE=1 skips what docs/benchmarks.md already has (the eager rows and compiled ViT-B).
if [ "${SKIP_DONE:-0}" != 1 ]; then
vb --model vit_base_patch16_224 --compile off
ck --model vit_base_patch16_224 --task infer; ck --model vit_base_patch16_224 --task train
vb --model deit_small_patch16_224 --compile off
ck --model deit_small_patch16_224 --task infer; ck --model deit_small_patch16_224 --task train
vb --model deit_tiny_patch16_224 --compile off
vb --model deit_base_patch16_224 --compile off
vb --model vit_base_patch16_224 --compile default
fi
ck --model vit_base_patch16_224 --task infer --compile default
vb --model deit_small_patch16_224 --compile default
vb --model deit_tiny_patch16_224 --compile default
vb --model deit_base_patch16_224 --compile default
say "done"
# weights and input examples stay behind (a store that holds a training run's would not come back)
tar czf $OUT/store.tgz --exclude='*.safetensors' --exclude='*.pt' --exclude='*.pt2' --exclude='*.pth' \
  --exclude='*input_example.json' -C "$GPU_RUNS" . && say "store packed: $(du -h $OUT/store.tgz | cut -f1)"
