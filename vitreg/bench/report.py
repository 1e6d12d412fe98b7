"""Human-readable output: the terminal table and report.md (environment block + results table)."""

from __future__ import annotations

import pandas as pd

from vitreg.analysis.frame import options_shown_in
from vitreg.analysis.render import RESULT_HEADERS, code_block, inert, markdown_table, result_rows
from vitreg.bench.results import BenchResult
from vitreg.bench.runner import INFER_EAGER_STEPS_BEFORE_CAPTURE
from vitreg.config.options import identity_names
from vitreg.config.parse import param_text
from vitreg.environment import EnvInfo
from vitreg.measure.graphs import EAGER_STEPS_BEFORE_CAPTURE


def _fmt(value, spec=",.1f", none="-") -> str:
    return none if value is None else format(value, spec)


def _rows(result: BenchResult) -> list[list[str]]:
    return result_rows({"task": t.task, "batch_size": t.batch_size, "metrics": t.metrics()} for t in result.tasks)


HEADERS = RESULT_HEADERS


def results_table(result: BenchResult) -> str:
    """Fixed-width table for the terminal."""
    rows = [HEADERS] + _rows(result)
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADERS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join([result.summary_line(), *lines])


def _markdown(headers: list[str], rows: list[list[str]]) -> str:
    return markdown_table(pd.DataFrame(rows, columns=headers))


def cudnn_text(raw: str | None) -> str | None:
    """torch's cuDNN version integer as a version: ``91002`` -> ``9.10.2`` (cuDNN 9 packs
    major*10000 + minor*100 + patch), ``8907`` -> ``8.9.7`` (cuDNN 8: major*1000 + minor*100 + patch)."""
    if not raw or not str(raw).isdigit():
        return raw
    number = int(raw)
    major, rest = divmod(number, 10000) if number >= 10000 else divmod(number, 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def _cuda_rows(result: BenchResult, env: EnvInfo) -> list[list[str]]:
    """The GPU software stack. torch reports the CUDA, cuDNN and NCCL it was built with, also on a host
    without a GPU: where no GPU ran they are shown as the build's (or not at all for a CPU-only build)."""
    stack = f"{env.cuda_version or '-'} / {cudnn_text(env.cudnn_version) or '-'} / {env.nccl_version or '-'}"
    if result.device == "cuda":
        return [["driver / CUDA / cuDNN / NCCL", f"{env.driver_version or '-'} / {stack}"]]
    if env.cuda_version:
        return [["torch build: CUDA / cuDNN / NCCL", f"{stack} (not used: no GPU ran)"]]
    return []


def _gpu_text(result: BenchResult, env: EnvInfo) -> str:
    if not env.gpu_count:
        return f"none (CPU: {env.cpu_model}, {env.cpu_count} cores)"
    gpus = f"{env.gpu_name} x{env.gpu_count} ({_fmt(env.gpu_memory_gb, '.0f')} GB, cc {env.compute_capability or '-'})"
    return gpus if result.device == "cuda" else f"{gpus}, not used: the run was on {result.device}"


# The identity options the Configuration table's own rows show (model, image size, precision / attention,
# compile, CUDA graph); every other identity option of bench gets a row `name | value`, so two reports of
# different configurations differ in this table, and an option added to the table appears here unasked.
_NAMED_ROWS = ("model", "img_size", "amp", "sdpa", "compile", "compile_backend", "cuda_graph")


def _identity_rows(result: BenchResult) -> list[list[str]]:
    """``[name, value]`` of each identity option of bench that no named row shows; the DDP settings only
    where several processes ran (in one they do nothing)."""
    spec = result.spec
    several = max((t.figures.get("world_size") or 1 for t in result.tasks), default=1) > 1
    names = [n for n in identity_names("bench") if n not in _NAMED_ROWS and hasattr(spec, n)]
    return [[n, param_text(getattr(spec, n))] for n in names if several or n not in options_shown_in("ddp")]


def report_markdown(result: BenchResult, env: EnvInfo, command: str | None = None) -> str:
    """report.md: what ran, where, and what it measured."""
    spec = result.spec
    env_rows = [
        ["GPU", _gpu_text(result, env)],
        ["label", f"{result.gpu}"],
        *_cuda_rows(result, env),
        ["torch / torchvision / timm / mlflow",
         f"{env.torch_version} / {env.torchvision_version} / {env.timm_version} / {env.mlflow_version}"],
        ["python / OS", f"{env.python_version} / {env.os}"],
        ["host / vitreg commit", f"{env.hostname} / {env.vitreg_git_sha}"],
    ]
    cfg_rows = [
        ["model", f"{result.model.name} ({result.model.source}, {result.model.params_m:.1f} M params)"],
        ["image size", str(result.model.img_size)],
        ["precision / attention", result.summary_line()],
        ["compile", f"{spec.compile} ({spec.compile_backend})" if spec.compile != "off" else "off (eager)"],
        ["CUDA graph", f"yes: each step captured once (after {EAGER_STEPS_BEFORE_CAPTURE} eager steps for train, "
                       f"{INFER_EAGER_STEPS_BEFORE_CAPTURE} for infer), timed as replays" if spec.cuda_graph else "no"],
        ["timing", f"{spec.warmup} warm-up iters, {spec.repeats} windows x {spec.steps} iters, "
                   f"{'CUDA events' if result.device == 'cuda' else 'perf_counter'}"],
        *_identity_rows(result),
        ["forward GFLOPs / image", f"{result.fwd_gflops_per_img:.2f}"],
    ]
    parts = [f"# vitreg benchmark: {inert(result.model.name)} on {inert(result.gpu)}", ""]
    if command:  # the command line holds the run name and every value typed: a block it cannot close
        parts += [code_block(command), ""]
    parts += ["## Environment", "", _markdown(["", ""], env_rows), "",
              "## Configuration", "", _markdown(["", ""], cfg_rows), "",
              "## Results", "", _markdown(HEADERS, _rows(result)), "",
              "Throughput: images per second over a whole timed window, median of the windows (min-max in "
              "brackets); CV: std/mean of the window throughputs. Latency: one iteration (one batch) in ms. "
              "Training iterations are forward + loss + backward + optimizer step. MFU: achieved FLOP/s over the "
              "GPU's dense datasheet peak for the active precision. Compile time: the first call alone, apart "
              "from the timed windows.", ""]
    return "\n".join(parts)

