#!/bin/bash
# vitreg vs the independent loop, eager, on one H200: vitreg bench runs (through `mlflow run`) + the independent loop.
# Run on the device machine: bash benchmarks/bench_vs_independent_mlflow_run.sh  (results under $OUT)
set -u
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv | tee $OUT/nvidia-smi.txt
ck() { python3 benchmarks/independent_check.py "$@" 2>/dev/null | tee -a $OUT/independent.jsonl; }
vb() { python3 -m mlflow run . -e bench --env-manager local --experiment-name h200-bench -P gpu=h200 -P amp=bf16 "$@" \
       > >(grep -E '^(infer|train|task|-----|logged)' | tee -a $OUT/vitreg.log) 2> >(grep -E 'error|Error|Traceback|failed' >&2); }
for m in vit_base_patch16_224 deit_tiny_patch16_224 deit_small_patch16_224 deit_base_patch16_224; do
  vb -P model=$m -P batch_size=256 -P compile=off
done
vb -P model=vit_base_patch16_224 -P batch_size=1024 -P task=infer
vb -P model=vit_base_patch16_224 -P batch_size=128 -P task=train
for m in vit_base_patch16_224 deit_tiny_patch16_224 deit_small_patch16_224; do
  ck --model $m --batch-size 256 --task infer; ck --model $m --batch-size 256 --task train
done
ck --model vit_base_patch16_224 --batch-size 1024 --task infer
ck --model vit_base_patch16_224 --batch-size 128 --task train
tar czf $OUT/gpu-runs-eager.tgz -C "$GPU_RUNS" .
