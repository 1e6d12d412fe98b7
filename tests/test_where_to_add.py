"""docs/ARCHITECTURE.md's "Where to add" table, held to its word.

Per row, the addition the row names is made to a copy of the source (a GPU profile to ``PROFILES``, a
metric to ``METRICS`` with the code that computes it, an option to ``OPTIONS`` and its spec field: the
edits a newcomer makes, in the files the row lists) and a fresh interpreter on that copy shows it
everywhere the row promises: the CLI's ``--help`` (click's CliRunner), the generated MLproject and README
text, a sweep's Ray request, a real benchmark's logged metrics, the bench report, compare's output. A fresh
interpreter because click's options, the specs' fields and the metric lookups are built from the tables
at import, as they are when a user runs vitreg: patching a table after import would test a state no user
ever has. The model-family row registers a family in-process (the registry is read at call time).
"""

from __future__ import annotations

import json
import re
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# What every row's check builds on: a bench result and an environment, as report.md takes them.
_RESULT = """
import json
from types import SimpleNamespace
from vitreg.bench.results import BenchResult, TaskResult
from vitreg.config.spec import BenchSpec
from vitreg.measure.figures import Figures, Work
from vitreg.models.factory import ModelInfo

def result(spec=None, gpu="cpu"):
    figures = Figures("infer", {"window_img_per_s": (100.0, 101.0, 102.0), "latency_ms": (80.0, 80.0, 81.0),
                                "first_call_s": 1.0, "warmup_s": 0.5, "gflops_per_img": 4.6})
    task = TaskResult("infer", 8, 224, 3, 3, figures.summarized().completed(Work()))
    info = ModelInfo("test_vit", "timm", 224, 16, 1000, 5.7, False)
    return BenchResult(spec or BenchSpec(model="test_vit"), gpu, "off", "cpu", info, 4.6, (task,))

ENV = SimpleNamespace(gpu_name="", gpu_count=0, gpu_memory_gb=None, compute_capability=None, driver_version=None,
                      cuda_version=None, cudnn_version=None, nccl_version=None, torch_version="2", timm_version="1",
                      torchvision_version="0", mlflow_version="3", python_version="3", os="linux", cpu_model="x",
                      cpu_count=2, hostname="h", vitreg_git_sha="abc")

def runs(*rows):
    import pandas as pd
    from vitreg.tracking.search import tidy
    base = {"status": "FINISHED", "params.model": "test_vit", "params.task": "infer", "params.batch_size": "8",
            "params.img_size": "224", "tags.amp": "off", "params.compile": "off"}
    return tidy(pd.DataFrame([{**base, "run_id": f"r{i}", **row} for i, row in enumerate(rows)]))

def compared(df, tmp, **kw):
    from vitreg.analysis.comparison import compare_runs
    from vitreg.analysis.render import format_table
    from vitreg.analysis.report import write_report
    c = compare_runs(df, **kw)
    write_report(c, tmp)
    return {"terminal": format_table(c), "md": open(f"{tmp}/comparison.md").read(),
            "html": open(f"{tmp}/comparison.html").read()}
"""


def _tree_with(tmp_path: Path, file: str, anchor: str, entry: str) -> Path:
    """A copy of the package (and the README and MLproject it generates) in which ``file`` holds ``entry``
    right after ``anchor``, which opens its table: the one edit the row promises is enough."""
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "vitreg", tree / "vitreg", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("README.md", "MLproject"):
        shutil.copy(ROOT / name, tree / name)
    path = tree / file
    text = path.read_text()
    assert text.count(anchor) == 1, f"{file} no longer opens its table with {anchor!r}: update this test"
    path.write_text(text.replace(anchor, anchor + textwrap.indent(textwrap.dedent(entry).strip("\n"), "    ") + "\n"))
    return tree


def _run_in(tree: Path, code: str) -> dict:
    """``code`` (after :data:`_RESULT`) in a fresh interpreter on ``tree``; the JSON it prints last."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-c", _RESULT + textwrap.dedent(code)], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_gpu_profile_is_one_entry_in_profiles(tmp_path):
    tree = _tree_with(tmp_path, "vitreg/hardware/profiles.py", "    for p in [\n", """
        GpuProfile("b200", "NVIDIA B200", {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 80.0}, "10.0",
                   (r"b200",), ray_type="B200"),
    """)
    seen = _run_in(tree, f"""
        from click.testing import CliRunner
        from vitreg.cli.main import main
        from vitreg.config import generate
        from vitreg.bench.results import report_markdown
        from vitreg.hardware import profiles as p
        from vitreg.hardware.precision import precision_of
        from vitreg.fleet.ray_engine import ray_type
        detected = p.DetectedHardware("cuda", "NVIDIA B200", 1, p.match_profile("NVIDIA B200"))
        hw = p.resolve_hardware("b200", detected)
        df = runs({{"tags.gpu": "b200", "tags.detected_gpu": "b200", "metrics.infer_throughput_img_per_s": 900}},
                  {{"tags.gpu": "a100", "tags.detected_gpu": "a100", "metrics.infer_throughput_img_per_s": 300}})
        print(json.dumps({{"help": CliRunner().invoke(main, ["bench", "--help"], terminal_width=200).output,
                          "readme": generate.readme_table("bench"), "label": hw.label,
                          "mfu": precision_of("bf16").mfu(1125.0, hw.profile), "amp": hw.profile.default_amp,
                          "ray": ray_type("b200"), "ray_back": p.label_of_ray_type("B200"),
                          "report": report_markdown(result(gpu=hw.label), ENV),
                          **compared(df, {str(tmp_path / 'cmp')!r}, baseline="a100")}}))
    """)
    assert "b200" in seen["help"].split("GPU label (")[1].split(")")[0]  # the gpu option's help lists it
    assert "`b200`" in next(line for line in seen["readme"].splitlines() if line.startswith("| `gpu`"))
    assert seen["label"] == "b200" and seen["mfu"] == pytest.approx(0.5) and seen["amp"] == "bf16"
    # a sweep's Ray task asks for what a Ray node with the card reports (Ray's own name for it), and back
    nvidia = pytest.importorskip("ray._private.accelerators.nvidia_gpu")
    assert seen["ray"] == nvidia.NvidiaGPUAcceleratorManager._gpu_name_to_accelerator_type("NVIDIA B200") == "B200"
    assert seen["ray_back"] == "b200"
    assert seen["report"].startswith("# vitreg benchmark: test_vit on b200")
    assert "b200" in seen["terminal"] and "3.00x" in seen["terminal"] and "MISLABELLED" not in seen["terminal"]
    assert "| b200 " in seen["md"] and "<td>b200</td>" in seen["html"]


@pytest.mark.slow
def test_a_metric_is_a_row_in_metrics_and_the_code_that_computes_it(tmp_path):
    """The metric row's files: its ``Metric`` in METRICS and its ``Column`` in REPORT_COLUMNS
    (vitreg/measure/metrics.py), and the code that computes it, here a job-level formula in DERIVED
    (vitreg/measure/figures.py). A real benchmark of a tiny model then logs it to a real store under its
    per-task name, report.md shows it, compare compares it in its direction, DDP ranks combine it by its rule."""
    from conftest import migrated_store

    tree = _tree_with(tmp_path, "vitreg/measure/metrics.py", "METRICS: tuple[Metric, ...] = (\n", """
        Metric("ms_per_img", "ms", LOWER, "job", ".4f", compared=TASKS, doc="ms of the whole job per image"),
    """)
    metrics_py = tree / "vitreg/measure/metrics.py"  # and its column in the bench report, in the same file
    anchor = "REPORT_COLUMNS: tuple[Column, ...] = (\n"
    metrics_py.write_text(metrics_py.read_text().replace(anchor, anchor + '    Column("ms/img", "{ms_per_img}"),\n'))
    figures_py = tree / "vitreg/measure/figures.py"  # the code that computes it, from the job's own figures
    anchor = "DERIVED = {\n"
    assert figures_py.read_text().count(anchor) == 1, "figures.py no longer opens DERIVED: update this test"
    figures_py.write_text(figures_py.read_text().replace(anchor, anchor + (
        '    "ms_per_img": lambda values, work: (1e3 / values["throughput_img_per_s"]\n'
        '                                        if values.get("throughput_img_per_s") else None),\n')))
    store = migrated_store(tmp_path)
    seen = _run_in(tree, f"""
        import os
        os.environ["MLFLOW_TRACKING_URI"] = {store!r}
        import mlflow
        import vitreg
        from vitreg.bench.results import report_markdown
        from vitreg.measure.metrics import combine
        measured = vitreg.api.bench(model="test_vit", img_size=32, batch_size=2, warmup=1, steps=2, repeats=1,
                                    task="infer", experiment="where-to-add")
        logged = mlflow.search_runs(experiment_names=["where-to-add"]).iloc[0]
        try:
            combine("ms_per_img", [0.25, 0.5])
            rule = "combined from the ranks"
        except ValueError:
            rule = "computed after the reduction"
        df = runs(*({{"tags.gpu": g, "metrics.infer_throughput_img_per_s": 100, "metrics.infer_ms_per_img": v}}
                    for g, v in (("a100", 0.9), ("a100", 0.91), ("h200", 0.3), ("h200", 0.31))))
        print(json.dumps({{"logged": float(logged["metrics.infer_ms_per_img"]),
                          "throughput": float(logged["metrics.infer_throughput_img_per_s"]),
                          "report": report_markdown(measured, ENV), "columns": list(df.columns),
                          "rule": rule,
                          **compared(df, {str(tmp_path / 'cmp')!r}, baseline="a100", metric="ms_per_img")}}))
    """)
    assert seen["logged"] == pytest.approx(1e3 / seen["throughput"], rel=1e-6)  # measured, computed, logged
    header = next(line for line in seen["report"].splitlines() if "ms/img" in line)
    row = seen["report"].splitlines()[seen["report"].splitlines().index(header) + 2]
    assert f"{seen['logged']:.4f}" in row  # report.md's results table, in the metric's format
    assert "ms_per_img" in seen["columns"]  # the tidy frame's stable schema
    assert seen["rule"] == "computed after the reduction"  # a "job" row: DDP computes it from the job's figures
    assert "lower is better" in seen["terminal"] and "2.97x" in seen["terminal"]  # 0.905 / 0.305: its direction
    assert "ms_per_img median (ms)" in seen["md"] and "ms_per_img median (ms)" in seen["html"]


@pytest.mark.slow
def test_an_option_is_one_entry_in_options(tmp_path):
    tree = _tree_with(tmp_path, "vitreg/config/options.py", "OPTIONS: tuple[Option, ...] = (\n", """
        Option("channels_last", "bool", False, "true: NHWC input and weights.", ("bench",),
               doc="`true`: input and weights in channels-last (NHWC) memory layout", identity=True),
    """)
    spec_py = tree / "vitreg/config/spec.py"  # a spec field: its line in the spec's class body, in table order
    body = spec_py.read_text()
    head, cls, rest = body.partition("class BenchSpec(")
    anchor = '\n\n    gpu: str = "auto"\n'  # the class body's first field, after its docstring
    assert cls and anchor in rest, "BenchSpec's body no longer starts with gpu: update this test"
    spec_py.write_text(head + cls + rest.replace(anchor, '\n\n    channels_last: bool = False' + anchor[1:], 1))
    stale = subprocess.run([sys.executable, "-m", "vitreg.config.generate", "--check"], cwd=tree,
                           env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True)
    assert stale.returncode == 1 and "make mlproject" in stale.stderr  # the one command the row names
    seen = _run_in(tree, f"""
        from click.testing import CliRunner
        from vitreg.cli.main import main
        from vitreg.config import generate
        from vitreg.bench.job import SCALING_CONFIG_TAGS
        from vitreg.bench.results import report_markdown
        from vitreg.tracking.tags import identity_tags
        spec = BenchSpec.from_options({{"model": "test_vit", "channels_last": "true"}})
        df = runs(*({{"tags.gpu": g, "params.channels_last": on, "metrics.infer_throughput_img_per_s": v}}
                    for g, on, v in (("a100", "false", 100), ("a100", "true", 150), ("h200", "false", 300),
                                     ("h200", "true", 600))))
        print(json.dumps({{"help": CliRunner().invoke(main, ["bench", "--help"], terminal_width=200).output,
                          "mlproject": generate.mlproject_text(), "readme": generate.readme_table("bench"),
                          "params": spec.to_params(), "tags": identity_tags(spec),
                          "scaling": list(SCALING_CONFIG_TAGS), "report": report_markdown(result(spec), ENV),
                          **compared(df, {str(tmp_path / 'cmp')!r}, baseline="a100")}}))
    """)
    assert "--channels-last" in seen["help"] and "NHWC input" in seen["help"]
    assert '      channels_last: {type: string, default: "false"}' in seen["mlproject"].splitlines()
    assert "--channels-last {channels_last}" in seen["mlproject"]
    assert "| `channels_last` | `false` | `true`: input and weights in channels-last" in seen["readme"]
    assert seen["params"]["channels_last"] == "true" and seen["tags"]["channels_last"] == "true"
    assert "channels_last" in seen["scaling"]  # a scaling baseline must agree on it
    assert "| channels_last" in seen["report"] and "| true" in seen["report"]  # report.md's configuration
    # compare keeps the two layouts apart (two configurations, each with its own speedup) and shows the column
    header = next(line for line in seen["terminal"].splitlines() if "model" in line.split())
    assert "channels_last" in header.split() and "3.00x" in seen["terminal"] and "4.00x" in seen["terminal"]
    table = seen["md"].split("## Per configuration")[1]
    assert "channels_last" in next(line for line in table.splitlines() if line.startswith("|"))  # its header


def test_a_model_family_is_one_registration_in_families(monkeypatch):
    """The row's one file (vitreg/models/families.py): a family is one register_family(...). Without it its
    models are refused in one line before any work; registered, they build, are read by the memory floor and
    SDPA check (``architecture``) and are listed in the ``model`` option's help text."""
    from vitreg.errors import VitregError
    from vitreg.models import families
    from vitreg.models.factory import create_model

    builtin = families.family_of("test_vit")
    monkeypatch.setattr(builtin, "prefixes", tuple(p for p in builtin.prefixes if p != "test_vit"))
    with pytest.raises(VitregError, match="no family"):
        families.family_of("test_vit")
    added = families.TimmFamily("test_vit")
    monkeypatch.setattr(families, "_FAMILIES", [*families._FAMILIES, added])
    assert families.check_name("test_vit", listed_before_ok=False) is added
    model, info = create_model("test_vit", 0)
    assert info.name == "test_vit" and info.patch_size > 0 and info.params_m > 0
    assert families.architecture_of(model).tokens > 1
    assert "test_vit*" in families.names_text()


def test_every_file_the_table_names_exists():
    text = (ROOT / "docs/ARCHITECTURE.md").read_text()
    table = text.split("## Where to add")[1].split("\n## ")[0]
    rows = [r for r in table.splitlines() if r.startswith(("| a ", "| an "))]
    assert len(rows) >= 5 and all("`vitreg/" in r for r in rows), rows  # each row names the files it touches
    named = {w for w in table.split("`")[1::2] if w.startswith("vitreg/") and "::" not in w}
    assert [n for n in named if not (ROOT / n).exists()] == []


def test_report_md_shows_every_identity_option_of_bench():
    """Each identity option of bench is in report.md's configuration table (a named row, or ``name | value``);
    the DDP settings only where several processes ran."""
    from types import SimpleNamespace

    from vitreg.analysis.frame import options_shown_in
    from vitreg.bench.results import report_markdown
    from vitreg.bench.results import BenchResult, TaskResult
    from vitreg.config.options import identity_names
    from vitreg.config.spec import BenchSpec
    from vitreg.measure.figures import Figures, Work
    from vitreg.models.factory import ModelInfo

    def report(nproc: int) -> str:
        figures = Figures("train", {"window_img_per_s": (100.0, 101.0), "step_ms": (80.0, 81.0), "first_call_s": 1.0,
                                    "warmup_s": 0.5, "gflops_per_img": 4.6})
        task = TaskResult("train", 8, 224, 3, 3, figures.summarized().completed(Work(world_size=nproc)))
        spec = BenchSpec.from_options({"model": "test_vit", "nproc": str(nproc), "ddp_comm_hook": "bf16"})
        env = SimpleNamespace(gpu_name="", gpu_count=0, gpu_memory_gb=None, compute_capability=None,
                              driver_version=None, cuda_version=None, cudnn_version=None, nccl_version=None,
                              torch_version="2", timm_version="1", torchvision_version="0", mlflow_version="3",
                              python_version="3", os="linux", cpu_model="x", cpu_count=2, hostname="h",
                              vitreg_git_sha="abc")
        info = ModelInfo("test_vit", "timm", 224, 16, 1000, 5.7, False)
        return report_markdown(BenchResult(spec, "cpu", "off", "cpu", info, 4.6, (task,)), env)

    shown = {"model": "| model ", "img_size": "| image size ", "amp": "| precision / attention ",
             "sdpa": "sdpa=auto", "compile": "| compile ", "compile_backend": "| compile ",
             "cuda_graph": "| CUDA graph "}
    several, one = report(2), report(1)
    for name in identity_names("bench"):
        if name == "nnodes":  # not a spec field: the processes of the whole job are the nproc row's world
            continue
        assert shown.get(name, f"| {name} ") in several, name
    assert re.search(r"\| ddp_comm_hook +\| bf16 ", several)
    assert not [n for n in options_shown_in("ddp") if f"| {n} " in one]  # in one process they do nothing
