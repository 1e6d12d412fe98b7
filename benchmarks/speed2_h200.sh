#!/bin/bash
# Issue 23 (speed II) on one H200: vitreg beside timm's own benchmark.py AND the independent CUDA-event loop
# (benchmarks/independent_check.py), one configuration after the other, in the same call. From the project root:
#   ITEMS="gap trio" bash benchmarks/speed2_h200.sh
# Needs benchmarks/timm_benchmark.py: timm's benchmark.py of the installed timm (1.0.29), copied there from
# github.com/huggingface/pytorch-image-models on the machine that sends the call (never committed here).
# Items (they run in this order: gap, state, trio, mission, fp8, trio2):
#   gap       benchmarks/timm_gap.py on DeiT-S and DeiT-Ti, batch 1024, compiled: timm's workload bisected
#   state     benchmarks/process_state.py: one fresh process per global switch (none, cudnn.benchmark, TF32, both),
#             the patch embedding as a conv or as one matmul, DeiT-S and DeiT-Ti bs1024 compiled; DeiT-S eager
#   trio      vitreg / timm benchmark.py / independent loop for each line of $CONFIGS (model task batch compile)
#   fp8       amp=fp8 (tensor-wise), fp8-rowwise ($FP8_MODES) on ViT-B/16 infer bs1024 compiled (vitreg logs
#             its accuracy against bf16 and its MFU), then the independent loop's tensorwise
#   trio2     like trio, for the lines of $CONFIGS2, after fp8
#   mission   the mission's command twice (mlflow run . -e bench -P gpu=h200): the second run reuses the
#             batch_size=auto cache; the wall time of each
# Writes $OUT/log.txt (timestamped lines), $OUT/trio.jsonl (one JSON line per measurement) and what each item
# adds (profile tables). DEADLINE (s, default 500): no item starts after it; each measurement has its own timeout.
set -u
START=$(date +%s); DEADLINE=${DEADLINE:-500}
ITEMS=" ${ITEMS:-gap trio} "
source benchmarks/gpu_env.sh
# one compile cache for all three tools: the second and third compile of a configuration are warm (steady-state
# figures do not depend on it; the device time does)
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache VITREG_COMPILE_CACHE=/tmp/inductor-cache
export MLFLOW_EXPERIMENT_NAME=h200-bench
LOG=$OUT/log.txt; J=$OUT/trio.jsonl
say() { echo "[$(( $(date +%s) - START ))s] $*" | tee -a $LOG; }
left() { [ $(( $(date +%s) - START )) -lt $DEADLINE ] || { say "deadline: skipping $*"; return 1; }; }
want() { case "$ITEMS" in *" $1 "*) left "item $1" ;; *) return 1 ;; esac; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw,power.limit \
  --format=csv,noheader | tee -a $LOG
python3 -c "import torch, timm; print('torch', torch.__version__, 'timm', timm.__version__)" | tee -a $LOG
TIMING=${TIMING:-"--warmup 10 --steps 20 --repeats 5"}

timm_bench() {  # model task batch compile [extra]: timm's benchmark.py, its samples/s into trio.jsonl
  local m=$1 t=$2 b=$3 c=$4; shift 4
  local mode=$([ "$t" = infer ] && echo inference || echo train) comp=()
  [ "$c" != off ] && comp=(--torchcompile inductor)
  [ "$c" != off ] && [ "$c" != default ] && comp+=(--torchcompile-mode "$c")
  # timm's train benchmark uses SGD by default; vitreg and the loop use fused AdamW: ask timm for AdamW too
  local opt=(); [ "$t" = train ] && opt=(--opt adamw)
  timeout ${TB_TIMEOUT:-150} python3 benchmarks/timm_benchmark.py --model $m --bench $mode -b $b --amp --amp-dtype bfloat16 \
    --num-warm-iter 10 --num-bench-iter 100 --no-retry "${comp[@]}" "${opt[@]}" "$@" >$OUT/last_tb.txt 2>&1
  local r=$(grep -oE '"(infer|train)_samples_per_sec": [0-9.]+' $OUT/last_tb.txt | awk '{print $2}')
  echo "{\"tool\": \"timm\", \"model\": \"$m\", \"task\": \"$t\", \"batch\": $b, \"compile\": \"$c\", \"img_per_s\": ${r:-null}}" \
    | tee -a $J | tee -a $LOG
  [ -n "$r" ] || tail -3 $OUT/last_tb.txt | tee -a $LOG
}
ck() {  # model task batch compile: the independent loop
  local m=$1 t=$2 b=$3 c=$4; shift 4
  timeout ${CK_TIMEOUT:-150} python3 benchmarks/independent_check.py --model $m --task $t --batch-size $b --compile $c \
    --amp bf16 --warmup 10 --iters 20 --repeats 5 "$@" 2>$OUT/last_ck.txt | sed 's/^{/{"tool": "independent", /' \
    | tee -a $J | cut -c1-200 | tee -a $LOG
  grep -E 'Error|error' $OUT/last_ck.txt | tail -1 | tee -a $LOG
}
vb() {  # model task batch compile [extra vitreg options]: vitreg bench, its results table line into trio.jsonl
  local m=$1 t=$2 b=$3 c=$4; shift 4
  timeout ${VB_TIMEOUT:-200} python3 -m vitreg.cli bench --gpu h200 --model $m --task $t --batch-size $b --compile $c \
    --amp bf16 $TIMING "$@" 2>$OUT/last_vb.txt >$OUT/last_vb_table.txt
  cat $OUT/last_vb_table.txt >> $OUT/tables.txt
  local line=$(grep -E "^$t " $OUT/last_vb_table.txt | tail -1)
  echo "{\"tool\": \"vitreg\", \"model\": \"$m\", \"task\": \"$t\", \"batch\": $b, \"compile\": \"$c\", \"extra\": \"$*\", \"row\": \"$line\"}" \
    | tee -a $J | tee -a $LOG
  grep -E '^error|Error|fp8 against|batch_size=auto|cache' $OUT/last_vb.txt | tail -4 | sed 's/^/    /' | tee -a $LOG
}
trio() {  # one configuration, three tools back to back
  left "$*" || return 0; say "trio $*"
  timm_bench "$@"; ck "$@"; vb "$@"
}

if want gap; then
  for m in deit_small_patch16_224 deit_tiny_patch16_224; do
    left "gap $m" || break; say "timm_gap $m 1024"
    timeout ${GAP_TIMEOUT:-170} python3 benchmarks/timm_gap.py --model $m --batch-size 1024 --out $OUT 2>$OUT/gap-stderr.txt \
      | tee -a $OUT/gap.jsonl | cut -c1-300 | tee -a $LOG
    grep -E 'Error|error' $OUT/gap-stderr.txt | tail -2 | tee -a $LOG
  done
fi
if want state; then  # fresh process per global switch (benchmarks/process_state.py)
  for m in deit_small_patch16_224 deit_tiny_patch16_224; do
    for sp in "none conv" "cudnn conv" "tf32 conv" "both conv" "none linear" "cudnn linear"; do
      set -- $sp; left "state $m $sp" || break
      timeout 90 python3 benchmarks/process_state.py --model $m --state $1 --patch $2 2>>$OUT/state-stderr.txt \
        | tee -a $OUT/state.jsonl | cut -c1-260 | tee -a $LOG
    done
  done
  for s in none cudnn; do
    left "state eager $s" && timeout 90 python3 benchmarks/process_state.py --state $s --compile off \
      2>>$OUT/state-stderr.txt | tee -a $OUT/state.jsonl | cut -c1-260 | tee -a $LOG
  done
fi
if want trio; then
  CONFIGS=${CONFIGS:-"deit_small_patch16_224 infer 1024 default
deit_tiny_patch16_224 infer 1024 default"}
  while read -r m t b c; do [ -n "$m" ] && trio $m $t $b $c; done <<< "$CONFIGS"
fi
if want mission; then
  for i in 1 2; do
    left "mission $i" || break; say "mission's command, run $i"
    s=$(date +%s.%N)
    timeout ${MISSION_TIMEOUT:-240} mlflow run . -e bench --env-manager local -P gpu=h200 >$OUT/mission$i.txt 2>&1
    say "mission run $i: rc=$? wall $(python3 -c "print(round($(date +%s.%N) - $s, 1))") s"
    grep -E 'batch_size=auto|^(infer|train) |^error' $OUT/mission$i.txt | tail -8 | sed 's/^/    /' | tee -a $LOG
  done
fi
if want fp8; then
  for r in ${FP8_MODES:-fp8 fp8-rowwise}; do
    left "fp8 $r" || break; say "vitreg amp=$r"
    vb vit_base_patch16_224 infer 1024 default --amp $r
  done
  left "fp8 independent" && ck vit_base_patch16_224 infer 1024 default --amp fp8
fi
if want trio2; then  # a second list, after the others (CONFIGS2)
  while read -r m t b c; do [ -n "$m" ] && trio $m $t $b $c; done <<< "${CONFIGS2:-}"
fi
say "done"
