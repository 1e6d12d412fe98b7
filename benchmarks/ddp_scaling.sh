#!/bin/bash
# DDP scaling on an nvidia-h200-x2 machine (2 H200s), from the project root, with .whl/ carried (gpu_env.sh):
#   bash benchmarks/ddp_scaling.sh
# (a) training throughput of ViT-B/16 and DeiT-S: `vitreg bench --task train --amp bf16 --batch-size 128
#     --gpu h200` at nproc=1, then nproc=2 with --baseline-run <the nproc=1 run> (train_scaling_efficiency);
# (b) DeiT-Ti trained 300 steps on synthetic data, registered as models:/deit-tiny-h200@champion, pulled
#     back (--out under /tmp) and benchmarked with `vitreg infer`; the loss read back from the store;
# (c) if time is left: the same DeiT-Ti training under DDP (`vitreg train --nproc 2`, NCCL), 100 steps;
# (d) each (a) pair is followed by more nproc=2 runs with other DDP settings (DDP_VARIANTS: static graph, bigger
#     buckets, a comm hook), then the independent plain DDP loop (benchmarks/ddp_check.py) at N=1 and N=2 (with the
#     profiler's NCCL time per step) on the same configuration (PLAIN_VARIANTS: more N=2 runs); DDP_CHECK=0 skips it.
# SKIP_TRAIN=1 / SKIP_TRAIN_DDP=1 leave out (b) / (c); DDP_VARIANTS="" leaves out (d). With
# BENCH_EXTRA="--cuda-graph true" PLAIN_EXTRA="--amp bf16 --cuda-graph" both vitreg and the plain loop replay
# whole-step CUDA graphs.
# Order = priority: the first model's (a)+(d), (b), the other models' (a)+(d), (c). Progress with timestamps goes to $OUT/log.txt; the
# MLflow store (mlflow.db + artifacts, minus weights and optimizer states, which would not come back) to
# $OUT/store.tgz. DEADLINE: no item starts after it; every item's timeout is cut to end by HARD, so the
# whole call stays under 9 minutes. Each command's own stdout/stderr stay in $WORK (/tmp), with a tail in
# the log when it fails.
# Rehearsed on a CPU (2 cores, ~2.5 min) with ENV_SCRIPT=none, a store of its own and tiny settings:
#   R=/tmp/rehearse; mkdir -p $R/runs; PATH=$PWD/.venv/bin:$PATH PYTHONPATH=$PWD GPU_RUNS=$R/runs \
#   MLFLOW_TRACKING_URI=sqlite:///$R/runs/mlflow.db MLFLOW_ARTIFACT_ROOT=$R/runs/artifacts ENV_SCRIPT=none \
#   OUT=$R/out WORK=$R/work GPU=cpu AMP=off BENCH_MODELS="test_vit deit_tiny_patch16_224" BENCH_BS=4 \
#   BENCH_EXTRA="--img-size 32 --device cpu --warmup 1 --steps 3 --repeats 2" TRAIN_MODEL=test_vit TRAIN_STEPS=50 \
#   TRAIN_BS=16 DDP_STEPS=25 TRAIN_EXTRA="--img-size 32 --device cpu --num-classes 10 --lr 2e-3 --label-smoothing 0" \
#   INFER_EXTRA="--device cpu --warmup 2 --steps 5 --repeats 2" \
#   PLAIN_EXTRA="--device cpu --img-size 32 --amp off --warmup 1 --iters 3 --repeats 2" bash benchmarks/ddp_scaling.sh
set -u
START=$(date +%s)
DEADLINE=${DEADLINE:-420}  # seconds after START: no new item starts
HARD=${HARD:-510}          # seconds after START: every running item is stopped (the tarball follows)
ENV_SCRIPT=${ENV_SCRIPT:-benchmarks/gpu_env.sh}
[ "$ENV_SCRIPT" = none ] || source "$ENV_SCRIPT"  # none: the caller set GPU_RUNS, MLFLOW_* and PYTHONPATH
export PYTHONUNBUFFERED=1
# NVLink multicast stays off (KINDS.md), also for the torchrun workers, which inherit this environment
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/issue3-out}; mkdir -p "$OUT"
WORK=${WORK:-/tmp/issue3}; mkdir -p "$WORK"
LOG=$OUT/log.txt
GPU=${GPU:-h200}; AMP=${AMP:-bf16}
BENCH_MODELS=${BENCH_MODELS:-"vit_base_patch16_224 deit_small_patch16_224"}
BENCH_BS=${BENCH_BS:-128}; BENCH_EXTRA=${BENCH_EXTRA:-}
TRAIN_MODEL=${TRAIN_MODEL:-deit_tiny_patch16_224}; TRAIN_STEPS=${TRAIN_STEPS:-300}; TRAIN_BS=${TRAIN_BS:-256}
TRAIN_EXTRA=${TRAIN_EXTRA:-}; DDP_STEPS=${DDP_STEPS:-100}
INFER_EXTRA=${INFER_EXTRA:-}
# the plain DDP loop's options matching BENCH_EXTRA (e.g. "--device cpu --img-size 32 --amp off" in rehearsal)
PLAIN_EXTRA=${PLAIN_EXTRA:-"--amp $AMP"}; [ "$AMP" = bf16 ] || [ "$AMP" = off ] || PLAIN_EXTRA=
# after each model's nproc=2 run: more nproc=2 runs with these DDP settings (|-separated; "" for none), and more
# plain-loop N=2 runs with PLAIN_VARIANTS; PLAIN_N1=0 leaves out the plain loop's N=1
DDP_VARIANTS=${DDP_VARIANTS-"--ddp-static-graph true|--ddp-bucket-mb 100 --ddp-static-graph true"}
PLAIN_VARIANTS=${PLAIN_VARIANTS-}
REG=${REG:-deit-tiny-h200}
PULL_DIR=/tmp/$REG-pulled

say() { echo "[$(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }
left() { [ $(( $(date +%s) - START )) -lt "$DEADLINE" ] || { say "deadline: skipping $*"; return 1; }; }
tmo() { local rest=$(( HARD - ($(date +%s) - START) )); [ "$rest" -lt "$1" ] && echo "$rest" || echo "$1"; }
run_id() { sed -nE 's/^(\[rank0\]: )?logged run ([0-9a-f]+) .*/\2/p' "$1" | tail -1; }
why() {  # the last error line of a failed item, into the log
  say "  FAILED (status $1): $(grep -hE '^error: |Error' "$2" | tail -2 | cut -c1-400 | tr '\n' ' ')"
}
python3 - <<'PY'  # the experiments this script logs to, with their artifacts beside the db (one tarball)
import mlflow, os
for name in ("h200-ddp", "h200-train", "h200-bench"):
    if mlflow.get_experiment_by_name(name) is None:
        mlflow.create_experiment(name, artifact_location="file://" + os.environ["MLFLOW_ARTIFACT_ROOT"] + "/" + name)
PY
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,temperature.gpu,power.draw \
  --format=csv,noheader | tee -a "$LOG"
python3 -c 'import torch; print("torch", torch.__version__, "cuda GPUs:", torch.cuda.device_count())' | tee -a "$LOG"

RUN=
bench() {  # bench MODEL NPROC [more options]: sets RUN to the run id
  local model=$1 nproc=$2 f=$WORK/bench-$1-n$2; shift 2; RUN=
  left "bench $model nproc=$nproc" || return 1
  say "vitreg bench --model $model --nproc $nproc --task train --amp $AMP --batch-size $BENCH_BS --gpu $GPU $BENCH_EXTRA $*"
  MLFLOW_EXPERIMENT_NAME=h200-ddp timeout "$(tmo 200)" python3 -m vitreg.cli bench --model "$model" --nproc "$nproc" \
    --task train --amp "$AMP" --batch-size "$BENCH_BS" --gpu "$GPU" $BENCH_EXTRA "$@" >"$f.out" 2>"$f.err"
  local rc=$?
  sed -E 's/^\[rank0\]: //' "$f.out" | grep -E '^(task|train) ' | tee -a "$LOG"
  grep -hE 'scaling vs baseline_run|not logging scaling' "$f.err" | sed -E 's/^.*\[vitreg\] //' | tee -a "$LOG"
  RUN=$(run_id "$f.out")
  [ "$rc" -eq 0 ] && [ -n "$RUN" ] || { why "$rc" "$f.err"; RUN=; return 1; }
  say "  run $RUN"
}
declare -A BASE  # model -> its nproc=1 run
bench_pair() {  # nproc=1, then nproc=2 against it, each DDP variant at nproc=2, then the plain loop
  local base variant
  bench "$1" 1 && base=$RUN || base=
  BASE[$1]=$base
  bench "$1" 2 ${base:+--baseline-run "$base"} --profile-steps 5  # + the all-reduce time per step, after the windows
  local IFS='|'
  for variant in $DDP_VARIANTS; do
    IFS=' '; bench "$1" 2 ${base:+--baseline-run "$base"} --profile-steps 5 $variant; IFS='|'
  done
  IFS=' '
  [ "${PLAIN_N1:-1}" = 1 ] && plain "$1" 1
  plain "$1" 2 --profile
  IFS='|'
  for variant in $PLAIN_VARIANTS; do
    IFS=' '; plain "$1" 2 --profile $variant; IFS='|'
  done
}
plain() {  # plain MODEL NPROC [ddp_check options]: the independent DDP loop (benchmarks/ddp_check.py) on the same config
  local model=$1 nproc=$2; shift 2
  [ "${DDP_CHECK:-1}" = 1 ] || return 0
  left "ddp_check $model nproc=$nproc" || return 1
  say "torchrun --standalone --nproc-per-node=$nproc benchmarks/ddp_check.py --model $model --batch-size $BENCH_BS $PLAIN_EXTRA $*"
  timeout "$(tmo 120)" python3 -m torch.distributed.run --standalone --nproc-per-node="$nproc" benchmarks/ddp_check.py \
    --model "$model" --batch-size "$BENCH_BS" $PLAIN_EXTRA "$@" >>"$OUT/ddp_check.jsonl" 2>"$WORK/plain.err"
  local rc=$?
  grep -E '^ddp_check: ' "$WORK/plain.err" | sed 's/^/  /' | tee -a "$LOG"
  [ "$rc" -eq 0 ] || why "$rc" "$WORK/plain.err"
}
TRAIN_RUN=
train_register_pull_infer() {
  left "train $TRAIN_MODEL" || return 1
  local f=$WORK/train
  say "vitreg train --model $TRAIN_MODEL --steps $TRAIN_STEPS --batch-size $TRAIN_BS --amp $AMP --register-as $REG --alias champion --log-every 25 --gpu $GPU $TRAIN_EXTRA"
  MLFLOW_EXPERIMENT_NAME=h200-train timeout "$(tmo 240)" python3 -m vitreg.cli train --model "$TRAIN_MODEL" \
    --steps "$TRAIN_STEPS" --batch-size "$TRAIN_BS" --amp "$AMP" --register-as "$REG" --alias champion --log-every 25 \
    --gpu "$GPU" $TRAIN_EXTRA >"$f.out" 2>"$f.err"
  local rc=$?
  grep -E '^(trained|checkpoint:)' "$f.out" | tee -a "$LOG"
  grep -hE '\[vitreg\] registered ' "$f.err" | sed -E 's/^.*\[vitreg\] //' | tee -a "$LOG"
  TRAIN_RUN=$(run_id "$f.out")
  [ "$rc" -eq 0 ] && [ -n "$TRAIN_RUN" ] || { why "$rc" "$f.err"; return 1; }
  say "  run $TRAIN_RUN; the loss, read back from the store:"
  python3 - "$TRAIN_RUN" <<'PY' 2>&1 | tee -a "$LOG"
import sys
from mlflow.tracking import MlflowClient
c = MlflowClient()
run = c.get_run(sys.argv[1])
hist = sorted((m.step, m.value) for m in c.get_metric_history(run.info.run_id, "train_loss"))
m = run.data.metrics
print("  train_loss: " + ", ".join(f"{s}:{v:.3f}" for s, v in hist))
(s0, first), (s1, last) = hist[0], hist[-1]
print(f"  loss {first:.3f} at step {s0} -> {last:.3f} at step {s1}: {'FALLS' if last < first else 'DOES NOT FALL'}; "
      f"{m.get('train_throughput_img_per_s', float('nan')):,.0f} img/s, step p50 {m.get('train_step_ms_p50', float('nan')):.2f} ms, "
      f"MFU {m.get('train_mfu', float('nan')):.3f}, first step {m.get('train_first_step_s', float('nan')):.1f} s; "
      f"registered v{run.data.tags.get('registered_model_version')}")
PY
  left "pull" || return 1
  say "vitreg pull models:/$REG@champion --out $PULL_DIR"
  rm -rf "$PULL_DIR"
  timeout "$(tmo 120)" python3 -m vitreg.cli pull "models:/$REG@champion" --out "$PULL_DIR" >"$WORK/pull.out" 2>"$WORK/pull.err" \
    || { why $? "$WORK/pull.err"; return 1; }
  tee -a "$LOG" <"$WORK/pull.out"
  left "infer" || return 1
  say "vitreg infer --model-uri models:/$REG@champion --batch-size $TRAIN_BS --amp $AMP --gpu $GPU $INFER_EXTRA"
  MLFLOW_EXPERIMENT_NAME=h200-bench timeout "$(tmo 150)" python3 -m vitreg.cli infer --model-uri "models:/$REG@champion" \
    --batch-size "$TRAIN_BS" --amp "$AMP" --gpu "$GPU" $INFER_EXTRA >"$WORK/infer.out" 2>"$WORK/infer.err" \
    || { why $? "$WORK/infer.err"; return 1; }
  grep -E '^(task|infer|logged run)' "$WORK/infer.out" | tee -a "$LOG"
}

train_ddp() {
  left "train --nproc 2" || return 1
  local f=$WORK/train-ddp
  say "vitreg train --model $TRAIN_MODEL --nproc 2 --steps $DDP_STEPS --batch-size $TRAIN_BS --amp $AMP --log-every 25 --gpu $GPU $TRAIN_EXTRA"
  MLFLOW_EXPERIMENT_NAME=h200-train timeout "$(tmo 200)" python3 -m vitreg.cli train --model "$TRAIN_MODEL" --nproc 2 \
    --steps "$DDP_STEPS" --batch-size "$TRAIN_BS" --amp "$AMP" --log-every 25 --gpu "$GPU" $TRAIN_EXTRA \
    >"$f.out" 2>"$f.err"
  local rc=$?
  sed -E 's/^\[rank0\]: //' "$f.out" | grep -E '^trained' | tee -a "$LOG"
  local ddp_run; ddp_run=$(run_id "$f.out")
  [ "$rc" -eq 0 ] && [ -n "$ddp_run" ] || { why "$rc" "$f.err"; return 1; }
  say "  run $ddp_run"
  python3 - "$ddp_run" "$TRAIN_RUN" <<'PY' 2>&1 | tee -a "$LOG"
import sys
from mlflow.tracking import MlflowClient
c = MlflowClient()
ddp = c.get_run(sys.argv[1]).data.metrics
one = c.get_run(sys.argv[2]).data.metrics if len(sys.argv) > 2 and sys.argv[2] else {}
n = int(ddp.get("train_world_size", 1))
line = (f"  DDP train: world size {n}, {ddp['train_throughput_img_per_s']:,.0f} img/s "
        f"({ddp['train_throughput_img_per_s_per_gpu']:,.0f} per GPU), step p50 {ddp['train_step_ms_p50']:.2f} ms, "
        f"final loss {ddp['train_final_loss']:.3f}")
if one.get("train_throughput_img_per_s"):
    line += f"; vs the 1-process run: x{ddp['train_throughput_img_per_s'] / one['train_throughput_img_per_s']:.2f} " \
            f"(efficiency {ddp['train_throughput_img_per_s'] / (n * one['train_throughput_img_per_s']):.3f})"
print(line)
PY
}

set -- $BENCH_MODELS
first_model=${1:-}; shift; rest_models="$*"
[ -n "$first_model" ] && bench_pair "$first_model"
[ "${SKIP_TRAIN:-0}" = 1 ] || train_register_pull_infer  # SKIP_TRAIN=1: (b) was done in an earlier call
for model in $rest_models; do bench_pair "$model"; done
[ "${SKIP_TRAIN_DDP:-0}" = 1 ] || train_ddp  # SKIP_TRAIN_DDP=1: (c) was done in an earlier call

say "summary of this call's runs:"
python3 - "$START" <<'PY' 2>&1 | tee -a "$LOG"
import sys
from mlflow.tracking import MlflowClient
c = MlflowClient()
since = int(sys.argv[1]) * 1000
for name in ("h200-ddp", "h200-train", "h200-bench"):
    exp = c.get_experiment_by_name(name)
    runs = [r for r in c.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])
            if r.info.start_time >= since] if exp else []
    for r in runs:
        m, t = r.data.metrics, r.data.tags
        tp = m.get("train_throughput_img_per_s") or m.get("infer_throughput_img_per_s")
        eff = m.get("train_scaling_efficiency")
        print(f"  {name:10s} {r.info.status:8s} {t.get('vitreg_job', '?'):5s} {t.get('model', '?'):24s} "
              f"nproc {r.data.params.get('nproc', '1')}  "
              + (f"{tp:10,.0f} img/s" if tp else "         - img/s")
              + (f"  step p50 {m['train_step_ms_p50']:.2f} ms" if "train_step_ms_p50" in m else "")
              + (f"  scaling eff {eff:.3f}" if eff else "")
              + (f"  all-reduce {m['train_allreduce_ms_per_step']:.2f} ms/step" if "train_allreduce_ms_per_step" in m else "")
              + (f"  ddp bucket {t['ddp_bucket_mb']} MB static {t['ddp_static_graph']}" if "ddp_bucket_mb" in t else "")
              + (f" hook {t['ddp_comm_hook']}" if t.get("ddp_comm_hook", "none") != "none" else "")
              + ("  cuda-graph" if t.get("cuda_graph") == "true" else "")
              + (f"  error: {t['vitreg_error'][:120]}" if t.get("vitreg_error") else ""))
PY
say "done"
# weights, optimizer states, pt2 graphs and the 224 px input examples (JSON, MBs each) stay behind:
# what comes back is at most 16 MiB a file
tar czf "$OUT/store.tgz" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.pt2' --exclude='*.pth' \
  --exclude='*input_example.json' -C "$GPU_RUNS" . && say "store packed: $(du -h "$OUT/store.tgz" | cut -f1)"
