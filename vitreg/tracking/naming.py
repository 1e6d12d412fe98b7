"""How a run reads in the MLflow UI without any set-up: its name and its note (the run's description).

The runs list shows a name cut to its column (146 px in MLflow 3.17: 20-24 characters, measured in
Chromium), and no params or metrics until someone picks columns. So a name starts with what answers "which
GPU, how fast": the GPU label and the figure, then the workload (the model and its image size) and the rest::

    h200 · vit_b16 img224 · bf16 · bs256 · compile                              while it runs
    h200 · 8,635 img/s infer · vit_b16 img224 · bf16 · bs256 · compile          when it has finished
    h200 · 8,635 img/s infer · 2,101 img/s train · vit_b16 img224 · bf16 · ...  task=both
    a100≠cpu · 25.2 img/s train · deit_ti16 img224 · fp32 · bs64                filed as a100, ran on a CPU

The note (the run page's description) holds report.md's results table: the page answers "how fast".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from vitreg.analysis.render import RESULT_HEADERS, markdown_table, result_rows
from vitreg.console import plural

SEP = " · "
#: the tag MLflow's UI shows as a run's description
NOTE_TAG = "mlflow.note.content"

# timm's size words, as the ViT papers abbreviate them (ViT-Ti/16, ViT-B/16, ...)
_SIZES = {"tiny": "ti", "small": "s", "base": "b", "large": "l", "huge": "h", "giant": "g", "gigantic": "G"}
_SIZE_PATCH = re.compile(r"_(" + "|".join(_SIZES) + r")_patch(\d+)")


def short_model(model: str) -> str:
    """``vit_base_patch16_224`` -> ``vit_b16``, ``deit3_small_patch16_384`` -> ``deit3_s16_384``."""
    short = _SIZE_PATCH.sub(lambda m: f"_{_SIZES[m.group(1)]}{m.group(2)}", model)
    return short[: -len("_224")] if short != model and short.endswith("_224") else short


def rate(value: float) -> str:
    """``8,635``, ``12.9``, ``6.07``: three digits at least."""
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def throughput_text(task: str, value: float) -> str:
    """``("infer", 8635.2)`` -> ``8,635 img/s infer``: the figure first, within a cut column's 20 characters."""
    return f"{rate(value)} img/s {task}"


def gpu_text(gpu: str, ran_on: str | None = None) -> str:
    """``a100``; a run filed under a GPU that did not run it: ``a100≠cpu``."""
    return f"{gpu}≠{ran_on}" if ran_on and ran_on != gpu else gpu


@dataclass(frozen=True)
class RunTitle:
    """What a run's name says besides its batch and figures (``job``: said while there is no figure yet)."""

    gpu: str
    model: str
    amp: str
    compile: str = "off"
    nproc: int = 1
    cuda_graph: bool = False
    job: str | None = None
    ran_on: str | None = None
    img_size: int | None = None

    def workload(self) -> str:
        return short_model(self.model) + (f" img{self.img_size}" if self.img_size else "")

    def name(self, batch_size, throughputs: dict[str, float] | None = None) -> str:
        figures = [throughput_text(task, value) for task, value in (throughputs or {}).items()]
        parts = [gpu_text(self.gpu, self.ran_on), *(figures or ([self.job] if self.job else [])), self.workload()]
        parts += ["fp32" if self.amp == "off" else self.amp, f"bs{batch_size}"]
        if self.compile != "off":
            parts.append("compile" if self.compile == "default" else self.compile)
        if self.cuda_graph:
            parts.append("cudagraph")
        if self.nproc > 1:
            parts.append(f"x{self.nproc}")
        return SEP.join(str(p) for p in parts)


#: MLflow's run page draws a description's table with no cell padding or borders and collapses spaces, so
#: the cells of a plain markdown table run together (``1.7%4.00 / 5.00``, seen in Chromium): a no-break
#: space each side of every cell keeps them apart (a padding attribute or style is stripped by its sanitizer)
NBSP = "\u00a0"
_CELL_EDGE = re.compile(r"(?<!\\)\|")  # a cell boundary; ``\|`` inside a cell is text
_SEPARATOR_CELL = re.compile(r"\s*:?-+:?\s*")


def spaced_cells(table: str) -> str:
    lines = []
    for line in table.splitlines():
        cells = _CELL_EDGE.split(line)[1:-1]
        if cells and not all(_SEPARATOR_CELL.fullmatch(c) for c in cells):
            line = "|" + "|".join(f" {NBSP}{c.strip()}{NBSP} " for c in cells) + "|"
        lines.append(line)
    return "\n".join(lines)


def results_markdown(result: dict, mfu: bool = True) -> str:
    """The results table of a bench result (results.json) as markdown; ``mfu=False`` leaves MFU blank."""
    import pandas as pd

    tasks = result["tasks"] if mfu else [
        {**t, "metrics": {k: v for k, v in t["metrics"].items() if not k.endswith("_mfu")}} for t in result["tasks"]]
    return markdown_table(pd.DataFrame(result_rows(tasks), columns=RESULT_HEADERS))


def run_note(result: dict, ran_on: str | None = None) -> str:
    """The run's description: what ran, the results table, and where the rest is; a mislabelled run says so."""
    model = result["model"]["name"] if isinstance(result.get("model"), dict) else result.get("model", "?")
    speeds = "; ".join(f"{t['task']} **{rate(t['metrics'][t['task'] + '_throughput_img_per_s'])} img/s**"
                       for t in result["tasks"])
    lines = [f"**{model}** on **{result['gpu']}** ({result['device']}, precision {result['amp']}): {speeds}", ""]
    if ran_on:
        lines += [f"**MISLABELLED**: filed as `{result['gpu']}` but ran on `{ran_on}`; its figures are not "
                  f"{result['gpu']}'s (compare leaves it out of speedups unless include_mismatch=true).", ""]
    lines += [spaced_cells(results_markdown(result, mfu=not ran_on)), "",
              "Full report: artifact `report.md`; every number: `results.json`."]
    return "\n".join(lines)


def compare_run_name(experiment: str, summary: dict) -> str:
    """``compare gpu vs a100 · laptop · 6 runs`` (``· 1 mislabelled`` when some are)."""
    axis = f"compare {summary['by']}" + (f" vs {summary['baseline']}" if summary.get("baseline") else "")
    parts = [axis, experiment, plural(summary["n_runs"], "run")]
    if summary.get("n_mislabelled_runs"):
        parts.append(f"{summary['n_mislabelled_runs']} mislabelled")
    return SEP.join(parts)


def sweep_run_name(axes: dict[str, list], common: dict, n_children: int) -> str:
    """``sweep deit_ti16 img224 · amp×batch_size · 4 runs`` (or ``3 models``): ``mlflow run``'s name is random."""
    models = axes.get("model") or [common.get("model") or "?"]
    sizes = axes.get("img_size") or [common.get("img_size") or 0]
    what = (RunTitle("", str(models[0]), "", img_size=int(sizes[0]) or None).workload() if len(models) == 1
            else f"{len(models)} models")
    varied = [name for name, values in axes.items() if len(values) > 1]
    return SEP.join(["sweep " + what, *(["×".join(varied)] if varied else []), plural(n_children, "run")])


#: MLflow 3's UI opens in its GenAI layout (its "Evaluations" pages) unless the browser chose "Model
#: training" before (kept in its localStorage); a page's ``workflowType`` query parameter overrides that
#: choice (read in the UI's WorkflowTypeProvider, checked in Chromium). No server option turns the GenAI
#: home off, nor the assistant panel that opens once per browser on a page served from localhost.
CLASSIC_LAYOUT = "workflowType=machine_learning"


def runs_page(experiment_id: str, run_id: str | None = None) -> str:
    """The UI's path of an experiment's runs list, or of one run's page, in the "Model training" layout."""
    return f"#/experiments/{experiment_id}/runs" + (f"/{run_id}" if run_id else "") + f"?{CLASSIC_LAYOUT}"


def analysis_experiment(experiment: str) -> str:
    """Where compare and check file their runs: ``laptop/analysis``, so ``laptop``'s list stays the benchmarks."""
    return f"{experiment}/analysis"


def check_run_name(experiment: str, verdict: str) -> str:
    """``check · ci · regressed``."""
    return SEP.join(["check", experiment, verdict])


def compare_note(experiment: str, summary: dict, table: str, max_lines: int = 40) -> str:
    baseline = f", against `{summary['baseline']}`" if summary.get("baseline") else ""
    verdicts = ", ".join(f"{n} {verdict}" for verdict, n in (summary.get("verdicts") or {}).items())
    lines = table.splitlines()
    shown = lines[:max_lines] + ([f"... ({len(lines) - max_lines} more lines)"] if len(lines) > max_lines else [])
    # first, what answers the question: MLflow shows an experiment's description one line high until opened
    best = ", ".join(f"**{value}** in {n}" for value, n in (summary.get("best") or {}).items())
    gains = ", ".join(f"**{value}** {gain:.2f}x **{summary['baseline']}**"
                      for value, gain in (summary.get("geomean_speedup") or {}).items())
    headline = [f"best {summary['by']}: {best} of {plural(summary['n_configurations'], 'configuration')}"
                + (f"; geomean {gains}" if gains else "") + ".", ""] if best else []
    return "\n".join([*headline,
        f"**{summary['metric']}** of experiment **{experiment}** along **{summary['by']}**{baseline}: "
        f"{plural(summary['n_runs'], 'run')}, {plural(summary['n_configurations'], 'configuration')}"
        + (f", {summary['n_mislabelled_runs']} mislabelled" if summary.get("n_mislabelled_runs") else "")
        + (f"; verdicts: {verdicts}" if verdicts else "") + ".", "",
        "```", *shown, "```", "",
        "Full tables: artifacts `comparison/comparison.md`, `.csv`, `.html`; charts: `comparison/*.png`."])
