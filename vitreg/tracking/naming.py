"""How a run reads in the MLflow UI without any set-up: its name and its note (the run's description).

The runs list shows a run's name, cut to the first ~22 characters, and no params or metrics until
someone picks columns. So a name starts with what tells runs apart at a glance: the GPU label, then
(once the run has it) the throughput, then the configuration::

    h200 · vit_b16 · bf16 · bs256 · compile                 while it runs
    h200 · 8,635 img/s · vit_b16 · bf16 · bs256 · compile   when it has finished

The note (MLflow's ``mlflow.note.content`` tag, shown as the run page's description) holds the
results table of report.md, so the run page answers "how fast" without opening artifacts.

Pure text; the jobs set the name and the note through :mod:`vitreg.tracking.runs`.
"""

from __future__ import annotations

import re

from vitreg.analysis.render import RESULT_HEADERS, markdown_table, result_rows

SEP = " · "
#: the tag MLflow's UI shows as a run's description
NOTE_TAG = "mlflow.note.content"

# timm's size words, as the ViT papers abbreviate them (ViT-Ti/16, ViT-B/16, ...)
_SIZES = {"tiny": "ti", "small": "s", "base": "b", "large": "l", "huge": "h", "giant": "g", "gigantic": "G"}
_SIZE_PATCH = re.compile(r"_(" + "|".join(_SIZES) + r")_patch(\d+)")


def short_model(model: str) -> str:
    """``vit_base_patch16_224`` -> ``vit_b16``, ``deit3_small_patch16_384`` -> ``deit3_s16_384``: size and
    patch as the papers write them, the usual 224 px left out; other names unchanged."""
    short = _SIZE_PATCH.sub(lambda m: f"_{_SIZES[m.group(1)]}{m.group(2)}", model)
    return short[: -len("_224")] if short != model and short.endswith("_224") else short


def rate(value: float) -> str:
    """An img/s figure as a name shows it: ``8,635``, ``12.9``, ``6.07`` (three digits at least)."""
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def throughput_text(throughputs: dict[str, float]) -> str:
    """``{"infer": 8635.2}`` -> ``8,635 img/s``; two tasks: ``infer 8,635 · train 2,101 img/s``."""
    if len(throughputs) == 1:
        return f"{rate(next(iter(throughputs.values())))} img/s"
    return SEP.join(f"{task} {rate(value)}" for task, value in throughputs.items()) + " img/s"


def run_name(gpu: str, model: str, amp: str, batch_size: int, compile: str = "off", *, nproc: int = 1,
             cuda_graph: bool = False, throughputs: dict[str, float] | None = None, job: str | None = None) -> str:
    """The run's name: GPU label first, then the throughput (``throughputs``: per task, once measured),
    then the job when it is not a benchmark (``train``, ``infer``), model, precision, batch size and what
    else changes the figure (compile mode, CUDA graph, processes)."""
    parts = [gpu]
    if throughputs:
        parts.append(throughput_text(throughputs))
    if job:
        parts.append(job)
    parts += [short_model(model), "fp32" if amp == "off" else amp, f"bs{batch_size}"]
    if compile != "off":
        parts.append("compile" if compile == "default" else compile)
    if cuda_graph:
        parts.append("cudagraph")
    if nproc > 1:
        parts.append(f"x{nproc}")
    return SEP.join(str(p) for p in parts)


def results_markdown(result: dict, mfu: bool = True) -> str:
    """The results table of a bench result (``BenchResult.to_dict()``, results.json) as markdown;
    ``mfu=False`` leaves MFU blank (a mislabelled run's was taken against another GPU's peak)."""
    import pandas as pd

    tasks = result["tasks"] if mfu else [
        {**t, "metrics": {k: v for k, v in t["metrics"].items() if not k.endswith("_mfu")}} for t in result["tasks"]]
    return markdown_table(pd.DataFrame(result_rows(tasks), columns=RESULT_HEADERS))


def run_note(result: dict, ran_on: str | None = None) -> str:
    """The run's description: what ran, the results table, and where the rest is. ``ran_on``: the
    hardware that really ran a run filed under another GPU label (allow_gpu_mismatch), said first."""
    model = result["model"]["name"] if isinstance(result.get("model"), dict) else result.get("model", "?")
    speeds = "; ".join(f"{t['task']} **{rate(t['metrics'][t['task'] + '_throughput_img_per_s'])} img/s**"
                       for t in result["tasks"])
    lines = [f"**{model}** on **{result['gpu']}** ({result['device']}, precision {result['amp']}): {speeds}", ""]
    if ran_on:
        lines += [f"**MISLABELLED**: filed as `{result['gpu']}` but ran on `{ran_on}`; its figures are not "
                  f"{result['gpu']}'s (compare leaves it out of speedups unless include_mismatch=true).", ""]
    lines += [results_markdown(result, mfu=not ran_on), "",
              "Full report: artifact `report.md`; every number: `results.json`."]
    return "\n".join(lines)
