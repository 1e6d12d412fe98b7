#!/bin/bash
# The issue-13 speed levers on one H200, each measured with vitreg itself AND the independent loop
# (benchmarks/independent_check.py) for the same settings. Run on the device machine from the project root:
#   bash benchmarks/levers_h200.sh                 # every item, in priority order, until DEADLINE
#   ITEMS="5 9" bash benchmarks/levers_h200.sh     # only some items (a second call picks up what the first skipped)
#   DRY=1 bash benchmarks/levers_h200.sh           # a dry check on the CPU with a tiny model (no figures;
#                                                  # VENV=folder: the venv to use, default .venv)
# Items, most important and cheapest first:
#   1 the mission's command with no other params (mlflow run . -e bench -P gpu=h200), then the independent
#     loop at the batch each task chose (goals: >= 8,635 infer, >= 2,665 train img/s)
#   2 torchvision:vit_b_16, batch 32, amp=tf32, infer, eager and compile=default (goal >= 4,000 img/s)
#   3 best infer: ViT-B/16 bf16-weights, sdpa=flash, compile=default, batch 1024, with a FRESH compile cache
#     folder (this is the cold compile of item 4)
#   4 the same command again: the warm compile (goal: infer_compile_time_s >= 3x faster than item 3's)
#   5 train: ViT-B/16 autocast bf16, compile=default, batch 512 (3,529 img/s: short of the 3,600 goal; item 15
#     reached it at batch 1536)
#   6 profile=true once (ViT-B/16 infer, batch 256): trace + top-20 ops as artifacts
#   7 best infer with sdpa=cudnn
#   8 best infer with batch_size=auto (the search picks the batch, compile=default times it)
#   9 amp=fp8 (torchao; refused in one line if the image has no torchao)
#  10 compile=max-autotune, infer (bf16-weights, flash, 1024) and train (bf16, flash, 256)
#  11 train levers, independent loop only: torchao float8 training (tensorwise, rowwise), compiled, batch 512
#  12 train at batch 1024, compiled (vitreg + the independent loop)
#  13 train with sdpa=flash, compiled, batch FLASH_BATCH (256), then the independent loop: the whole stderr kept in
#     $OUT/flash-train-stderr.txt (it failed in calls 2 and 5: the FLOP count ran fp32 under the flash restriction)
#  15 best train: batch 1536, compiled, then the independent loop (2026-12-01: call 6 ran vitreg, call 7 the loop)
#  14 compile=max-autotune train, bf16, sdpa auto, batch MA_BATCH (512), then the independent loop
# Writes $OUT/log.txt (progress with timestamps), $OUT/independent.jsonl, $OUT/tables.txt (every vitreg results
# table) and $OUT/store.tgz (the MLflow store). DEADLINE (seconds) keeps one call under ~9 minutes: no item
# starts after it.
set -u
START=$(date +%s); DEADLINE=${DEADLINE:-470}
ITEMS=" ${ITEMS:-1 2 3 4 5 6 7 8 9 10} "
if [ "${DRY:-0}" = 1 ]; then  # the CPU, a tiny model, a few steps: checks the script, not the GPU
  OUT=${OUT:-/tmp/levers-dry}; mkdir -p "$OUT"
  export PYTHONPATH=$PWD PATH=${VENV:-$PWD/.venv}/bin:$PATH PYTHONUNBUFFERED=1 GPU_RUNS=$OUT/gpu-runs
  mkdir -p "$GPU_RUNS"; export MLFLOW_TRACKING_URI=sqlite:///$GPU_RUNS/mlflow.db
  GPU=cpu; AUTO_AMP=off; MODEL=test_vit; TV_MODEL=test_vit; BIG=16; MID=8; SMALL=4
  SIZE=(--img-size 32); SIZE_P=(-P model=test_vit -P img_size=32 -P warmup=2 -P steps=3 -P repeats=2)
  TIMING=(--warmup 2 --steps 3 --repeats 2); CK_TIMING=(--device cpu --img-size 32 --warmup 2 --iters 3 --repeats 2)
else
  source benchmarks/gpu_env.sh
  GPU=h200; AUTO_AMP=bf16; MODEL=vit_base_patch16_224; TV_MODEL=torchvision:vit_b_16; BIG=1024; MID=256; SMALL=32
  SIZE=(); SIZE_P=()
  TIMING=(--warmup 10 --steps 20 --repeats 5); CK_TIMING=(--warmup 10 --iters 20 --repeats 5)
fi
export MLFLOW_EXPERIMENT_NAME=h200-levers
# artifacts beside the db (profile=true traces, reports), so that store.tgz brings them back (calls 1-7 kept them
# in ./mlruns on the device: the profile=true trace of call 4 did not come back)
python3 -c "import mlflow, os; root = os.environ.get('MLFLOW_ARTIFACT_ROOT'); mlflow.get_experiment_by_name('h200-levers') \
  or mlflow.create_experiment('h200-levers', artifact_location=f'file://{root}/h200-levers' if root else None)"
LOG=$OUT/log.txt
say() { echo "[$(( $(date +%s) - START ))s] $*" | tee -a $LOG; }
left() { [ $(( $(date +%s) - START )) -lt $DEADLINE ] || { say "deadline: skipping $*"; return 1; }; }
want() { case "$ITEMS" in *" $1 "*) left "item $1" ;; *) return 1 ;; esac; }
table() {  # keep a results table (precision line included); then the run's one-line error, or its last line
  tee -a $OUT/tables.txt | grep -E '^(precision|infer|train) ' | tee -a $LOG
  { grep -E '^error' $OUT/last_stderr.txt || grep -E 'Error|error' $OUT/last_stderr.txt; } | tail -1 | sed 's/^/    /' \
    | tee -a $LOG
}
batch_of() { grep -E "^$1 " $OUT/last_table.txt | awk '{print $2}' | tail -1; }  # the batch a task ran
vb() {  # vitreg bench with the given options; the table into the log
  say "vitreg bench --gpu $GPU ${SIZE[*]} ${TIMING[*]} $*"
  timeout ${VB_TIMEOUT:-300} python3 -m vitreg.cli bench --gpu $GPU "${SIZE[@]}" "${TIMING[@]}" "$@" \
    2>$OUT/last_stderr.txt | tee $OUT/last_table.txt | table
  grep -E 'compile cache|batch_size=auto chose' $OUT/last_stderr.txt | sed 's/^/    /' | tee -a $LOG
}
ck() {  # the independent loop for the same settings
  say "independent_check ${CK_TIMING[*]} $*"
  timeout ${CK_TIMEOUT:-240} python3 benchmarks/independent_check.py "${CK_TIMING[@]}" "$@" 2>$OUT/last_ck_stderr.txt \
    | tee -a $OUT/independent.jsonl | cut -c1-220 | tee -a $LOG
  grep -E 'Error|error|inference only|needs' $OUT/last_ck_stderr.txt | tail -1 | sed 's/^/    /' | tee -a $LOG
}
FRESH_CACHE=/tmp/vitreg-levers-cache-$START  # (not CC: triton reads CC as its C compiler) item 3's fresh compile cache folder; item 4 reuses it warm
[ "${DRY:-0}" = 1 ] || nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
  --format=csv,noheader | tee -a $LOG
say "items:$ITEMS deadline ${DEADLINE}s"

if want 1; then
  say "mlflow run . -e bench --env-manager local -P gpu=$GPU ${SIZE_P[*]}"
  timeout ${MISSION_TIMEOUT:-420} mlflow run . -e bench --env-manager local -P gpu=$GPU "${SIZE_P[@]}" \
    2>$OUT/last_stderr.txt | tee $OUT/last_table.txt | table
  grep -E 'batch_size=auto chose' $OUT/last_stderr.txt | sed 's/^/    /' | tee -a $LOG
  BI=$(batch_of infer); BT=$(batch_of train)
  [ -n "$BI" ] && ck --model $MODEL --task infer --amp $AUTO_AMP --batch-size $BI  # what amp=auto resolves to
  [ -n "$BT" ] && ck --model $MODEL --task train --amp $AUTO_AMP --batch-size $BT
fi
if want 2; then
  vb --model $TV_MODEL --task infer --amp tf32 --batch-size $SMALL --compile off
  ck --model $TV_MODEL --task infer --amp tf32 --batch-size $SMALL
  vb --model $TV_MODEL --task infer --amp tf32 --batch-size $SMALL --compile default
  ck --model $TV_MODEL --task infer --amp tf32 --batch-size $SMALL --compile default
fi
BEST_INFER=(--model $MODEL --task infer --amp bf16-weights --sdpa flash --compile default --batch-size $BIG)
if want 3; then
  rm -rf $FRESH_CACHE; vb "${BEST_INFER[@]}" --compile-cache $FRESH_CACHE
  ck --model $MODEL --task infer --amp bf16-weights --sdpa flash --compile default --batch-size $BIG
fi
want 4 && vb "${BEST_INFER[@]}" --compile-cache $FRESH_CACHE
if want 5; then
  vb --model $MODEL --task train --amp bf16 --compile default --batch-size 512
  ck --model $MODEL --task train --amp bf16 --compile default --batch-size 512
fi
want 6 && vb --model $MODEL --task infer --batch-size $MID --profile true
if want 7; then
  vb --model $MODEL --task infer --amp bf16-weights --sdpa cudnn --compile default --batch-size $BIG
  ck --model $MODEL --task infer --amp bf16-weights --sdpa cudnn --compile default --batch-size $BIG
fi
want 8 && vb --model $MODEL --task infer --amp bf16-weights --sdpa flash --compile default --batch-size auto
if want 9; then
  vb --model $MODEL --task infer --amp fp8 --compile default --batch-size $BIG
  ck --model $MODEL --task infer --amp fp8 --compile default --batch-size $BIG
fi
if want 10; then
  vb --model $MODEL --task infer --amp bf16-weights --sdpa flash --compile max-autotune --batch-size $BIG
  ck --model $MODEL --task infer --amp bf16-weights --sdpa flash --compile max-autotune --batch-size $BIG
  left "item 10 train" && vb --model $MODEL --task train --amp bf16 --sdpa flash --compile max-autotune --batch-size $MID
fi
if want 11; then
  ck --model $MODEL --task train --amp fp8 --fp8-recipe tensorwise --compile default --batch-size 512
  left "item 11 rowwise" && ck --model $MODEL --task train --amp fp8 --fp8-recipe rowwise --compile default --batch-size 512
fi
if want 12; then
  vb --model $MODEL --task train --amp bf16 --compile default --batch-size $BIG
  ck --model $MODEL --task train --amp bf16 --compile default --batch-size $BIG
fi
if want 13; then  # FLASH_BATCH: the batch (256)
  vb --model $MODEL --task train --amp bf16 --sdpa flash --compile default --batch-size ${FLASH_BATCH:-$MID}
  cp $OUT/last_stderr.txt $OUT/flash-train-stderr.txt
  left "item 13 independent" && ck --model $MODEL --task train --amp bf16 --sdpa flash --compile default \
    --batch-size ${FLASH_BATCH:-$MID}
fi
if want 15; then
  vb --model $MODEL --task train --amp bf16 --compile default --batch-size 1536
  left "item 15 independent" && ck --model $MODEL --task train --amp bf16 --compile default --batch-size 1536
fi
if want 14; then  # MA_BATCH: the batch (512); MA_TIMEOUT: the vitreg run's limit (420 s: autotuning a training graph)
  VB_TIMEOUT=${MA_TIMEOUT:-420} vb --model $MODEL --task train --amp bf16 --compile max-autotune --batch-size ${MA_BATCH:-512}
  left "item 14 independent" && ck --model $MODEL --task train --amp bf16 --compile max-autotune --batch-size ${MA_BATCH:-512}
fi
say "done"
# weights and input examples stay behind (a store that holds a training run's would not come back)
tar czf $OUT/store.tgz --exclude='*.safetensors' --exclude='*.pt' --exclude='*.pt2' --exclude='*.pth' \
  --exclude='*input_example.json' -C "$GPU_RUNS" . && say "store packed: $(du -h $OUT/store.tgz | cut -f1)"
