"""How a run reads in the MLflow UI without any set-up: its name and its note (the run's description).

The runs list shows a run's name, cut to the first ~22 characters, and no params or metrics until
someone picks columns. So a name starts with what is compared: the GPU label, then (once the run has
it) the figure with its unit, then the model and the rest of the configuration::

    h200 · vit_b16 · bf16 · bs256 · compile                                while it runs
    h200 · infer 8,635 img/s · vit_b16 · bf16 · bs256 · compile            when it has finished
    h200 · infer 8,635 img/s · vit_b16 · train 2,101 img/s · bf16 · bs256  task=both
    a100≠cpu · train 25.2 img/s · deit_ti16 · fp32 · bs64                  filed as a100, ran on a CPU

The note (MLflow's ``mlflow.note.content`` tag, shown as the run page's description) holds the
results table of report.md, so the run page answers "how fast" without opening artifacts.

Pure text; the jobs set the name and the note through :mod:`vitreg.tracking.runs`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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


def throughput_text(task: str, value: float) -> str:
    """``("infer", 8635.2)`` -> ``infer 8,635 img/s``: the figure with its task and unit."""
    return f"{task} {rate(value)} img/s"


def gpu_text(gpu: str, ran_on: str | None = None) -> str:
    """``a100``; a run filed under a GPU that did not run it: ``a100≠cpu`` (what it was filed as, what ran)."""
    return f"{gpu}≠{ran_on}" if ran_on and ran_on != gpu else gpu


@dataclass(frozen=True)
class RunTitle:
    """What a run's name says of the run besides its batch and figures: the GPU label (``a100≠cpu`` when
    ``ran_on``, the hardware that really ran it, differs), the model, precision and what else changes the
    figure (compile mode, CUDA graph, processes); ``job`` (``train``, ``infer``) is said while there is no
    figure yet, the figure's task says it after."""

    gpu: str
    model: str
    amp: str
    compile: str = "off"
    nproc: int = 1
    cuda_graph: bool = False
    job: str | None = None
    ran_on: str | None = None

    def name(self, batch_size, throughputs: dict[str, float] | None = None) -> str:
        """The run's name, what is compared first (the runs list shows ~22 characters): the GPU, the first
        task's throughput with its unit (``throughputs``, once measured), the model; then the second task's
        figure, precision, batch size, compile mode, CUDA graph and processes."""
        parts = [gpu_text(self.gpu, self.ran_on)]
        figures = [throughput_text(task, value) for task, value in (throughputs or {}).items()]
        if figures:
            parts.append(figures[0])
        elif self.job:
            parts.append(self.job)
        parts += [short_model(self.model), *figures[1:], "fp32" if self.amp == "off" else self.amp, f"bs{batch_size}"]
        if self.compile != "off":
            parts.append("compile" if self.compile == "default" else self.compile)
        if self.cuda_graph:
            parts.append("cudagraph")
        if self.nproc > 1:
            parts.append(f"x{self.nproc}")
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


def compare_run_name(experiment: str, summary: dict) -> str:
    """A compare run's name, what is compared first: ``compare gpu vs a100 · laptop · 6 runs`` (``by`` and
    the baseline, the experiment compared, how many runs; ``· 1 mislabelled`` when some are)."""
    axis = f"compare {summary['by']}" + (f" vs {summary['baseline']}" if summary.get("baseline") else "")
    parts = [axis, experiment, f"{summary['n_runs']} runs"]
    if summary.get("n_mislabelled_runs"):
        parts.append(f"{summary['n_mislabelled_runs']} mislabelled")
    return SEP.join(parts)


def compare_note(experiment: str, summary: dict, table: str, max_lines: int = 40) -> str:
    """A compare run's description: what was compared along what, against what, and the table as printed."""
    baseline = f", against `{summary['baseline']}`" if summary.get("baseline") else ""
    verdicts = ", ".join(f"{n} {verdict}" for verdict, n in (summary.get("verdicts") or {}).items())
    lines = table.splitlines()
    shown = lines[:max_lines] + ([f"... ({len(lines) - max_lines} more lines)"] if len(lines) > max_lines else [])
    return "\n".join([
        f"**{summary['metric']}** of experiment **{experiment}** along **{summary['by']}**{baseline}: "
        f"{summary['n_runs']} runs, {summary['n_configurations']} configuration(s)"
        + (f", {summary['n_mislabelled_runs']} mislabelled" if summary.get("n_mislabelled_runs") else "")
        + (f"; verdicts: {verdicts}" if verdicts else "") + ".", "",
        "```", *shown, "```", "",
        "Full tables: artifacts `comparison/comparison.md`, `.csv`, `.html`; charts: `comparison/*.png`."])
