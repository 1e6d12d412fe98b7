#!/bin/bash
# Where the last few per cent of 2-GPU scaling go, on an nvidia-h200-x2 machine (2 H200s), from the project root
# with .whl/ carried (gpu_env.sh):
#   bash benchmarks/ddp_concurrency.sh
# For each model (MODELS), the plain DDP loop (benchmarks/ddp_check.py, whole-step CUDA graphs, bf16, 128 images
# per GPU) three ways, each over the same long windows (PLAIN_EXTRA):
#   alone       N=1 on GPU 0 while GPU 1 idles;
#   concurrent  N=1 on GPU 0 and, at the same time, another N=1 on GPU 1: no communication at all, both GPUs busy;
#   ddp         N=2 over NCCL (--profile: NCCL kernel time per step).
# If "concurrent" loses what "ddp" loses against "alone", the loss is the two GPUs being busy at once (power,
# clocks, the host), not DDP. nvidia-smi samples SM clock, power and throttle reasons every 500 ms into
# $OUT/smi.csv meanwhile, and each phase's start/end times go to the log, so the samples can be cut by phase
# (`python3 benchmarks/smi_phases.py $OUT/smi.csv $OUT/log.txt` does that for the vitreg phases).
# Then, if time is left, vitreg itself: `vitreg bench --task train --cuda-graph true` at nproc=1 and nproc=2 with
# each of VITREG_VARIANTS (|-separated; leading VAR=value words go to the environment, e.g. "NCCL_MAX_CTAS=8")
# against that nproc=1 run, for the first model. MODELS="" leaves out the plain-loop phases.
# Rehearsed on a CPU (2 cores, ~1.5 min):
#   R=/tmp/rehearse-c; mkdir -p $R/runs; PATH=$PWD/.venv/bin:$PATH PYTHONPATH=$PWD GPU_RUNS=$R/runs \
#   MLFLOW_TRACKING_URI=sqlite:///$R/runs/mlflow.db ENV_SCRIPT=none OUT=$R/out WORK=$R/work MODELS=test_vit \
#   PLAIN_EXTRA="--device cpu --img-size 32 --amp off --batch-size 4 --iters 3 --repeats 2" \
#   VITREG_EXTRA="--device cpu --img-size 32 --amp off --batch-size 4 --gpu cpu --warmup 1 --steps 3 --repeats 2" \
#   bash benchmarks/ddp_concurrency.sh
set -u
START=$(date +%s)
DEADLINE=${DEADLINE:-420}; HARD=${HARD:-510}
ENV_SCRIPT=${ENV_SCRIPT:-benchmarks/gpu_env.sh}
[ "$ENV_SCRIPT" = none ] || source "$ENV_SCRIPT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/concurrency-out}; mkdir -p "$OUT"; WORK=${WORK:-/tmp/concurrency}; mkdir -p "$WORK"
LOG=$OUT/log.txt
MODELS=${MODELS-"vit_base_patch16_224 deit_small_patch16_224"}
PLAIN_EXTRA=${PLAIN_EXTRA:-"--batch-size 128 --amp bf16 --cuda-graph --iters 30 --repeats 10"}
VITREG_VARIANTS=${VITREG_VARIANTS-"--ddp-bucket-mb 100|--ddp-static-graph true"}
VITREG_EXTRA=${VITREG_EXTRA:-"--amp bf16 --batch-size 128 --gpu h200 --cuda-graph true"}
say() { echo "[$(( $(date +%s) - START ))s $(date -u +%T)] $*" | tee -a "$LOG"; }
left() { [ $(( $(date +%s) - START )) -lt "$DEADLINE" ] || { say "deadline: skipping $*"; return 1; }; }
tmo() { local rest=$(( HARD - ($(date +%s) - START) )); [ "$rest" -lt "$1" ] && echo "$rest" || echo "$1"; }

command -v nvidia-smi >/dev/null && {
  nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv,noheader -lms 500 >"$OUT/smi.csv" 2>/dev/null & SMI=$!; }

plain() {  # plain TAG GPUS NPROC [options]: one torchrun of ddp_check.py on GPUS
  local tag=$1 gpus=$2 n=$3; shift 3
  CUDA_VISIBLE_DEVICES=$gpus timeout "$(tmo 100)" python3 -m torch.distributed.run --standalone --nproc-per-node="$n" \
    benchmarks/ddp_check.py $PLAIN_EXTRA "$@" >"$WORK/$tag.json" 2>"$WORK/$tag.err"
  local rc=$?
  sed 's/^/  /' "$WORK/$tag.json" >>"$OUT/ddp_check.jsonl"
  grep -E '^ddp_check: ' "$WORK/$tag.err" | sed "s/^/  $tag: /" | tee -a "$LOG"
  [ "$rc" -eq 0 ] || say "  $tag FAILED (status $rc): $(grep -E 'Error' "$WORK/$tag.err" | tail -1 | cut -c1-300)"
}

for model in $MODELS; do
  left "$model" || break
  say "phase alone $model: GPU 0, N=1"
  plain "alone-$model" 0 1 --model "$model"
  left "$model concurrent" || break
  say "phase concurrent $model: N=1 on GPU 0 and N=1 on GPU 1 at once"
  plain "concurrent0-$model" 0 1 --model "$model" & P0=$!
  plain "concurrent1-$model" 1 1 --model "$model" & P1=$!
  wait $P0 $P1
  left "$model ddp" || break
  say "phase ddp $model: N=2"
  plain "ddp-$model" 0,1 2 --model "$model" --profile
  say "phase end $model"
done

VMODEL=${VMODEL:-${MODELS%% *}}; vmodel=${VMODEL:-vit_base_patch16_224}
RUN=
bench() {  # bench NPROC [VAR=value ...] [options]: vitreg bench of the first model (VAR=value: its environment)
  local n=$1 f=$WORK/vitreg-n$1-$(date +%s) envs=() opts=() word; shift; RUN=
  for word in "$@"; do [[ $word =~ ^[A-Z_][A-Z0-9_]*= ]] && envs+=("$word") || opts+=("$word"); done
  left "vitreg bench nproc=$n $*" || return 1
  say "${envs[*]:+${envs[*]} }vitreg bench --model $vmodel --nproc $n --task train $VITREG_EXTRA ${opts[*]}"
  env "${envs[@]}" MLFLOW_EXPERIMENT_NAME=h200-ddp timeout "$(tmo 150)" python3 -m vitreg.cli bench --model "$vmodel" \
    --nproc "$n" --task train $VITREG_EXTRA "${opts[@]}" >"$f.out" 2>"$f.err"
  local rc=$?
  sed -E 's/^\[rank0\]: //' "$f.out" | grep -E '^(task|train) ' | tee -a "$LOG"
  grep -hE 'scaling vs baseline_run|not logging scaling' "$f.err" | sed -E 's/^.*\[vitreg\] //' | tee -a "$LOG"
  RUN=$(sed -nE 's/^(\[rank0\]: )?logged run ([0-9a-f]+) .*/\2/p' "$f.out" | tail -1)
  [ "$rc" -eq 0 ] && [ -n "$RUN" ] || { say "  FAILED (status $rc): $(grep -hE '^error: |Error' "$f.err" | tail -1 | cut -c1-300)"; RUN=; return 1; }
  say "  run $RUN"
}
if [ -n "$VITREG_VARIANTS" ] && bench 1; then
  base=$RUN; IFS='|'
  for variant in $VITREG_VARIANTS; do
    IFS=' '; bench 2 --baseline-run "$base" $variant; IFS='|'
  done
  IFS=' '
fi
[ -n "${SMI:-}" ] && kill "$SMI" 2>/dev/null
say "done"
[ -n "${GPU_RUNS:-}" ] && tar czf "$OUT/store.tgz" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.pt2' \
  --exclude='*.pth' --exclude='*input_example.json' -C "$GPU_RUNS" . && say "store packed"
