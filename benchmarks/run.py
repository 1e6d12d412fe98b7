"""One entry for vitreg's measurements: named suites of commands, each timed, their output kept, and a summary of
every run they logged (figures, timed windows, energy, overhead by phase, estimate against work) with the
command, the commit and the machine.

    python benchmarks/run.py --list                     # the suites, the machine each needs, their commands
    python benchmarks/run.py vs-independent --out DIR   # from the project root

GPU suites run on the lent machine their row names, after ``source benchmarks/gpu_env.sh`` (the wheels the image
lacks, a store under gpu-runs/); CPU suites anywhere, against the store MLFLOW_TRACKING_URI names.
``--deadline S``: no command starts after S seconds (a device call has a limit). Every command's output goes to
DIR/NAME.txt, a timestamped line per command to DIR/log.txt and, where nvidia-smi is, its samples every 500 ms to
DIR/smi.csv (``benchmarks/smi_phases.py DIR/smi.csv DIR/log.txt`` cuts them by vitreg bench command);
DIR/SUITE.json holds the commands, their exit status and wall time, and the runs they logged. ``{out}`` in a
command is DIR. timm's own ``benchmark.py`` is read from benchmarks/timm_benchmark.py: a copy of the installed
timm's, kept beside this file on the GPU machine only (it is timm's code: never committed). The figures and what
they mean: docs/benchmarks.md; each past measurement: benchmarks/results/*/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

PY = sys.executable


def _lent_gpu() -> str:
    """The lent card's label for the commands' gpu option (a run is filed under the GPU it ran on): h100 or h200."""
    try:
        name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30).stdout.lower()
    except (OSError, subprocess.TimeoutExpired):
        name = ""
    return "h100" if "h100" in name else "h200"


GPU = os.environ.get("GPU_LABEL") or _lent_gpu()
VITREG = [PY, "-m", "vitreg.cli"]
BENCH = [*VITREG, "bench", "--gpu", GPU]
CHECK = [PY, "benchmarks/independent_check.py"]
MISSION = ["mlflow", "run", ".", "-e", "bench", "--env-manager", "local", "-P", f"gpu={GPU}"]
TIMM = [PY, "benchmarks/timm_benchmark.py", "--model", "vit_base_patch16_224"]
SWEEP_FP8 = [*VITREG, "sweep", "--gpu", GPU, "--models", "vit_base_patch16_224", "--task", "infer", "--amp",
             "bf16,fp8", "--compile", "off,default", "--batch-size", "256,1024"]
SWEEP_TF32 = [*VITREG, "sweep", "--gpu", GPU, "--models", "vit_base_patch16_224", "--task", "infer", "--amp",
              "tf32,bf16", "--compile", "off,default", "--batch-size", "32,256"]
ALONE = [*BENCH, "--model", "vit_base_patch16_224", "--task", "infer", "--batch-size", "256"]
CPU_CHILD = ["--device", "cpu", "--amp", "off", "--compile", "off", "--warmup", "1", "--steps", "3", "--repeats", "2"]
CPU_SWEEP = [*VITREG, "sweep", "--models", "deit_tiny_patch16_224", *CPU_CHILD, "--batch-size", "4,8", "--axis",
             "img_size=32,48"]
DDP = [*VITREG, "bench", "--task", "train", "--amp", "bf16", "--batch-size", "128", "--gpu", GPU, "--cuda-graph",
       "true", "--experiment", "ddp"]
TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone"]
E2E = ["--device", "cpu", "--batch-size", "8", "--warmup", "2", "--steps", "5", "--repeats", "2"]


def pair(model: str, task: str, batch: int, amp: str = "bf16", *extra: str) -> list:
    """vitreg bench and the independent loop (no vitreg code) on one configuration, back to back."""
    name, opts = "_".join([model.split(":")[-1], task, amp, f"bs{batch}", *extra[1::2]]), [
        "--model", model, "--task", task, "--batch-size", str(batch), "--amp", amp, *extra]
    return [(f"vitreg_{name}", 200, [*BENCH, *opts, "--experiment", "vs-independent"]),
            (f"independent_{name}", 150, [*CHECK, *opts, "--iters", "30"])]


def trio(model: str, task: str, batch: int, compile_mode: str) -> list:
    """timm's benchmark.py (AdamW for training, as vitreg), the independent loop and vitreg on one configuration."""
    timm = [PY, "benchmarks/timm_benchmark.py", "--model", model, "--bench", {"infer": "inference"}.get(task, task),
            "-b", str(batch), "--amp", "--amp-dtype", "bfloat16", "--num-warm-iter", "10", "--num-bench-iter", "100",
            "--no-retry", *(["--opt", "adamw"] if task == "train" else []),
            *(["--torchcompile", "inductor"] if compile_mode != "off" else [])]
    name = f"{model}_{task}_bs{batch}_{compile_mode}"
    opts = ["--model", model, "--task", task, "--batch-size", str(batch), "--amp", "bf16", "--compile", compile_mode]
    return [(f"timm_{name}", 150, timm), (f"independent_{name}", 150, [*CHECK, *opts]),
            (f"vitreg_{name}", 200, [*BENCH, *opts, "--experiment", "vs-timm"])]


def peak() -> list:
    """Issue 46 in one call (H100 or H200: ``--gpu auto``), the most important first: ViT-B/16 bf16 compiled train at
    bs1536 in timm's benchmark.py (``--no-retry``: its retry would report bs1024's rate under the 1536 asked for) and
    in vitreg, plain and with AOTAutograd's activation budget 0.7 / 0.85 (benchmarks/with_budget.py: recompute in
    the backward to fit); the peak allocated at bs256 in timm and vitreg (both read torch.cuda.max_memory_allocated); DeiT-S infer
    bs1024 against timm; short screens of levers on ViT-B/16 infer bs1024 (CUDA graphs, fp8 per row / per tensor,
    cuDNN attention, max-autotune last)."""
    vit, deit = "vit_base_patch16_224", "deit_small_patch16_224"
    bench = ["bench", "--gpu", "auto", "--experiment", "peak"]
    timm = [PY, "benchmarks/timm_peak.py", "--amp", "--amp-dtype", "bfloat16", "--torchcompile", "inductor",
            "--no-retry"]
    bf16 = ["--amp", "bf16", "--compile", "default"]
    train = ["bench", "--gpu", "auto", "--model", vit, "--task", "train", *bf16, "--warmup", "5", "--steps", "10",
             "--repeats", "2", "--batch-size"]
    infer = [*VITREG, *bench, "--model", vit, "--task", "infer", "--batch-size", "1024", "--warmup", "10", "--steps",
             "20", "--repeats", "3"]
    budget = [PY, "benchmarks/with_budget.py"]
    return [
        ("timm_train_bs1536", 130, [*timm, "--model", vit, "--bench", "train", "--opt", "adamw", "-b", "1536",
                                    "--num-warm-iter", "5", "--num-bench-iter", "20"]),
        ("vitreg_train_bs1536_budget0.7", 150, [*budget, "0.7", "vitreg.cli", *train, "1536",
                                                "--experiment", "peak-budget0.7"]),
        ("vitreg_train_bs1536", 120, [*VITREG, *train, "1536", "--experiment", "peak"]),
        ("timm_train_bs256", 90, [*timm, "--model", vit, "--bench", "train", "--opt", "adamw", "-b", "256",
                                  "--num-warm-iter", "5", "--num-bench-iter", "40"]),
        ("vitreg_train_bs256", 90, [*VITREG, *train, "256", "--experiment", "peak"]),
        ("timm_deit_s_infer_bs1024", 80, [*timm, "--model", deit, "--bench", "inference", "-b", "1024",
                                          "--num-warm-iter", "10", "--num-bench-iter", "100"]),
        ("vitreg_deit_s_infer_bs1024", 80, [*VITREG, *bench, *bf16, "--model", deit, "--task", "infer",
                                            "--batch-size", "1024", "--warmup", "10", "--steps", "25", "--repeats",
                                            "4"]),
        ("vitreg_train_bs1536_budget0.85", 150, [*budget, "0.85", "vitreg.cli", *train, "1536",
                                                 "--experiment", "peak-budget0.85"]),
        ("vitreg_infer_cuda_graph", 80, [*infer, *bf16, "--cuda-graph", "true"]),
        ("vitreg_infer_fp8_rowwise", 90, [*infer, "--amp", "fp8-rowwise", "--compile", "default"]),
        ("vitreg_infer_fp8_tensorwise", 90, [*infer, "--amp", "fp8-tensorwise", "--compile", "default"]),
        ("vitreg_infer_sdpa_cudnn", 80, [*infer, *bf16, "--sdpa", "cudnn"]),
        ("vitreg_infer_max_autotune", 150, [*infer, "--amp", "bf16", "--compile", "max-autotune"]),
    ]


#: suite -> (the machine it needs, [(name, timeout s, command)] run in this order)
SUITES = {
    # issue 46: memory at the peak batch against timm's benchmark.py, then the levers (``--deadline 420``)
    "peak": ("nvidia-h100-x1", peak()),
    # the mission's command on a fresh machine and again, beside timm's defaults; the sweeps
    "time-to-answer": ("nvidia-h200", [
        ("timm_infer", 120, [*TIMM, "--bench", "inference"]),
        ("timm_train", 120, [*TIMM, "--bench", "train"]),
        ("mission1", 200, MISSION),
        ("mission2", 200, MISSION),
        ("sweep_tf32", 240, [*SWEEP_TF32, "--experiment", "sweep-tf32"]),
        ("sweep_fp8", 330, [*SWEEP_FP8, "--experiment", "sweep-fp8"]),
    ]),
    # a GPU's measured batches (batch_cache.MEASURED): the mission's search (img_size=224 is the default's size,
    # another cache key: no kept batch), one task each
    "search": ("nvidia-h200", [(f"search_{task}", 150, [*BENCH, "--task", task, "--img-size", "224", "--experiment",
                                                        "search"]) for task in ("infer", "train")]),
    # a child in the warm worker against the same configurations in fresh processes (within 1 %: compare with
    # the children of time-to-answer's sweep_tf32), where a process's set-up goes (a profile), the fp8 sweep
    "sweep-isolation": ("nvidia-h200", [
        ("alone_bf16_eager", 120, [*ALONE, "--amp", "bf16", "--compile", "off", "--experiment", "alone"]),
        ("alone_tf32_compiled", 150, [*ALONE, "--amp", "tf32", "--compile", "default", "--experiment", "alone"]),
        ("profile", 150, [PY, "-m", "cProfile", "-o", "{out}/bench.prof", "-m", "vitreg.cli", *ALONE[3:], "--amp",
                          "bf16", "--compile", "off", "--experiment", "profile"]),
        ("profile_stats", 60, [PY, "-c", "import pstats, sys; pstats.Stats(sys.argv[1]).sort_stats('cumulative')"
                               ".print_stats(r'vitreg/|mlflow/(store|tracking)|torch/cuda', 70)", "{out}/bench.prof"]),
        ("sweep_fp8", 330, [*SWEEP_FP8, "--experiment", "sweep-fp8"]),
    ]),
    # vitreg within 1 % of timm's own benchmark.py: ViT-B eager (both tasks), the small models compiled
    "vs-timm": ("nvidia-h200", [
        *trio("vit_base_patch16_224", "infer", 512, "off"), *trio("vit_base_patch16_224", "train", 512, "off"),
        *trio("deit_small_patch16_224", "infer", 1024, "default"),
        *trio("deit_tiny_patch16_224", "infer", 1024, "default"),
    ]),
    # vitreg within 1 % of the independent loop in each mode that makes a figure of record
    "vs-independent": ("nvidia-h200", [
        *pair("vit_base_patch16_224", "infer", 512), *pair("vit_base_patch16_224", "train", 512),
        *pair("vit_base_patch16_224", "infer", 1024, "bf16-weights", "--sdpa", "cudnn", "--compile", "default"),
        *pair("vit_base_patch16_224", "infer", 1024, "fp8", "--compile", "default"),
        *pair("vit_base_patch16_224", "train", 1536, "bf16", "--compile", "default"),
        *pair("torchvision:vit_b_16", "infer", 32, "tf32"),
        *pair("deit_small_patch16_224", "train", 256),
    ]),
    # J/img: vitreg's energy trace beside the plain NVML loop (within 5 %); clocks and power limit left alone
    "energy": ("nvidia-h200", [
        (f"{name}_{task}", 200, cmd) for task, batch, steps, repeats in (("infer", 256, 200, 5), ("train", 1536, 12, 3))
        for name, cmd in (
            ("vitreg", ["env", f"VITREG_ENERGY_TRACE={{out}}/trace-{task}.jsonl", *BENCH, "--model",
                        "vit_base_patch16_224", "--amp", "bf16", "--compile", "default", "--task", task, "--batch-size",
                        str(batch), "--warmup", "10", "--steps", str(steps), "--repeats", str(repeats), "--experiment",
                        "energy"]),
            ("nvml_loop", [PY, "benchmarks/energy_check.py", "--task", task, "--batch-size", str(batch), "--iters",
                           str(steps), "--repeats", str(repeats), "--samples", f"{{out}}/samples-{task}.jsonl"]))
    ]),
    # 2-GPU training scaling, whole-step CUDA graphs, 128 images per GPU: vitreg at N=1 and N=2 (compare's table
    # gives the efficiency), the plain DDP loop beside it
    "ddp": ("nvidia-h200-x2", [
        *[(f"vitreg_{model}_{compile_mode}_n{n}", 200, [*DDP, "--model", model, "--compile", compile_mode, "--nproc",
                                                         str(n)])
          for model, compile_mode in (("deit_small_patch16_224", "default"), ("vit_base_patch16_224", "off"))
          for n in (1, 2)],
        *[(f"plain_{model}_{compile_mode}_n{n}", 150, [*TORCHRUN, f"--nproc-per-node={n}", "benchmarks/ddp_check.py",
                                                        "--model", model, "--compile", compile_mode, "--batch-size",
                                                        "128", "--cuda-graph", "--profile"])
          for model, compile_mode in (("deit_small_patch16_224", "default"), ("vit_base_patch16_224", "off"))
          for n in (1, 2)],
        ("compare", 120, [*VITREG, "compare", "--experiment", "ddp"]),
    ]),
    # eight CPU benches at once against one mlflow server, a probe timing runs/search meanwhile
    "server-load": ("cpu", [("server_load", 600, [PY, "benchmarks/server_load.py", "--runs", "8"])]),
    # what a sweep costs beyond its children: 4 CPU children in the warm worker, in a process each, the slowest
    # child alone; then 8 children on a Ray cluster of 1 and 2 nodes
    "sweep": ("cpu", [
        ("worker", 200, [*CPU_SWEEP, "--experiment", "sweep-worker"]),
        ("process", 300, [*CPU_SWEEP, "--isolate", "process", "--experiment", "sweep-process"]),
        ("slowest_child_alone", 120, [*VITREG, "bench", "--model", "deit_tiny_patch16_224", *CPU_CHILD, "--batch-size",
                                      "8", "--img-size", "48", "--experiment", "sweep-alone"]),
        ("ray", 600, [PY, "tests/test_fleet_cost.py"]),
    ]),
    # vitreg check over 5,000 client-made runs: the CLI and its phases, in steps
    "check-scale": ("cpu", [("check_scale", 600, [PY, "benchmarks/check_scale.py", "--runs", "5000", "--series",
                                                  "50"])]),
    # `vitreg runs` as a user runs it: in a folder with no store (bound: 1 s of CPU), over 1,000 runs (bound: 3 s)
    "runs-list": ("cpu", [("runs_scale", 300, [PY, "benchmarks/runs_scale.py", "--runs", "1000"])]),
    # train (registering models:/tiny-e2e@champion) -> pull -> infer on the CPU, tiny model
    "train-register-infer": ("cpu", [
        ("train", 300, [*VITREG, "train", "--model", "test_vit", "--img-size", "32", "--num-classes", "10",
                        "--batch-size", "16", "--device", "cpu", "--steps", "60", "--log-every", "10", "--lr", "2e-3",
                        "--label-smoothing", "0", "--register-as", "tiny-e2e", "--alias", "champion",
                        "--experiment", "e2e-train"]),
        ("pull", 120, [*VITREG, "pull", "models:/tiny-e2e@champion", "--out", "{out}/pulled"]),
        ("infer", 120, [*VITREG, "infer", "--model-uri", "models:/tiny-e2e@champion", *E2E, "--experiment", "e2e-infer"]),
    ]),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("suite", nargs="?", choices=sorted(SUITES))
    parser.add_argument("--out", default="out", help="folder for the outputs")
    parser.add_argument("--deadline", type=float, default=540.0, help="no command starts after this many seconds")
    parser.add_argument("--list", action="store_true", help="list the suites and their commands")
    args = parser.parse_args()
    if args.list or not args.suite:
        for suite, (machine, items) in SUITES.items():
            print(f"{suite} ({machine})\n" + "\n".join(f"  {name}: {shlex.join(cmd)}" for name, _, cmd in items))
        return 0
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")  # KINDS.md
    sampler = _nvidia_smi(out)
    started, started_ms, results = time.monotonic(), int(time.time() * 1000), []
    for name, limit, command in SUITES[args.suite][1]:
        command = [word.replace("{out}", str(out)) for word in command]
        elapsed = time.monotonic() - started
        if elapsed > args.deadline:
            results.append({"name": name, "command": shlex.join(command), "skipped": "deadline"})
            continue
        with open(out / "log.txt", "a") as log:  # smi_phases.py's format: [elapsed s hh:mm:ss] what
            log.write(f"[{elapsed:.0f}s {time.strftime('%H:%M:%S', time.gmtime())}] {name}: {shlex.join(command)}\n")
        results.append(_timed(name, min(limit, args.deadline + 60 - elapsed), command, out))
        print(json.dumps(results[-1]), flush=True)
    if sampler:
        sampler.terminate()
    record = {"suite": args.suite, "needs": SUITES[args.suite][0], "command": shlex.join([PY, *sys.argv]),
              "commit": _output(["git", "rev-parse", "--short", "HEAD"]),
              "machine": {"gpus": _output(["nvidia-smi", "--query-gpu=name,driver_version,power.limit",
                                           "--format=csv,noheader"]), "host": platform.platform(), "cpus": os.cpu_count()},
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commands": results,
              "runs": _runs(started_ms)}
    (out / f"{args.suite}.json").write_text(json.dumps(record, indent=1))
    for run in record["runs"]:
        print(json.dumps(run))
    return 0


def _timed(name: str, limit: float, command: list[str], out: Path) -> dict:
    begin = time.monotonic()
    with open(out / f"{name}.txt", "w") as log:
        try:
            status = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=limit).returncode
        except subprocess.TimeoutExpired:
            status = "timeout"
    return {"name": name, "command": shlex.join(command), "rc": status, "wall_s": round(time.monotonic() - begin, 1)}


def _output(command: list[str]) -> str:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _nvidia_smi(out: Path) -> subprocess.Popen | None:
    """nvidia-smi's clocks, power and throttle reasons every 500 ms into DIR/smi.csv, where there is one."""
    return shutil.which("nvidia-smi") and subprocess.Popen(
        ["nvidia-smi", "--query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,"
         "clocks_throttle_reasons.active", "--format=csv,noheader", "-lms", "500"], stdout=open(out / "smi.csv", "w"))


def _runs(since_ms: int) -> list[dict]:
    """Every run of the store started since the suite began, with a figure: its name, status, throughputs,
    energy, windows, estimate against work, overhead by phase and scaling."""
    from mlflow.tracking import MlflowClient

    client, rows = MlflowClient(), []
    for exp in client.search_experiments():
        for run in client.search_runs([exp.experiment_id], f"attributes.start_time >= {since_ms}",
                                      order_by=["attributes.start_time ASC"]):
            keep = {k: round(v, 4) for k, v in run.data.metrics.items() if k.startswith("overhead_") or k in (
                "work_s", "estimated_work_s") or k.endswith(("throughput_img_per_s", "_timed_windows", "_compile_time_s",
                                                               "ci95_halfwidth_pct", "energy_j_per_img",
                                                               "scaling_efficiency", "final_loss", "_mb"))}
            if keep:
                rows.append({"experiment": exp.name, "name": run.info.run_name, "status": run.info.status,
                             "parent": run.data.tags.get("mlflow.parentRunId"), **keep})
    return rows


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
