"""Precision modes: what each one runs, what it refuses, and that TF32 is switched back off after a run."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from vitreg.errors import VitregError
from vitreg.hardware.precision import (PRECISION_CHOICES, autocast, input_dtype, math_mode, prepare_model,
                                       resolve_precision)
from vitreg.hardware.profiles import PROFILES


def tiny_vit():
    import timm

    return timm.create_model("test_vit", pretrained=False, img_size=32).eval()


@pytest.mark.parametrize("amp, label", [("off", "fp32"), ("bf16", "autocast-bf16"), ("fp16", "autocast-fp16"),
                                        ("bf16-weights", "bf16-weights"), ("fp16-weights", "fp16-weights")])
def test_each_mode_names_what_ran(amp, label):
    assert resolve_precision(amp, "cpu").label == label


def test_tf32_and_fp8_labels_on_a_gpu_that_has_them(monkeypatch):
    assert resolve_precision("tf32", "cuda", capability=(9, 0)).label == "tf32"
    monkeypatch.setitem(sys.modules, "torchao", type(sys)("torchao"))
    monkeypatch.setitem(sys.modules, "torchao.quantization", type(sys)("torchao.quantization"))
    fp8 = resolve_precision("fp8", "cuda", capability=(9, 0))
    # amp=fp8 runs the recipe measured fastest (tensor-wise scales); each recipe is also asked for by name
    assert fp8.label == "fp8-torchao-tensorwise" and fp8.weights_dtype == "bf16" and fp8.inference_only
    assert resolve_precision("fp8-rowwise", "cuda", capability=(9, 0)).label == "fp8-torchao-rowwise"
    assert resolve_precision("fp8-tensorwise", "cuda", capability=(9, 0)).label == "fp8-torchao-tensorwise"
    with pytest.raises(VitregError, match=r"^amp=fp8-columnwise is not a precision mode: use one of .*fp8-rowwise"):
        resolve_precision("fp8-columnwise", "cuda", capability=(9, 0))


@pytest.mark.parametrize("amp, device, capability, tasks, needle", [
    ("bf16-weights", "cpu", None, ("infer", "train"), "use task=infer, or amp=bf16"),
    ("fp8", "cuda", (9, 0), ("train",), "inference only"),
    ("fp8", "cpu", None, ("infer",), "compute capability >= 8.9"),
    ("fp8", "cuda", (8, 0), ("infer",), "here compute capability 8.0: use amp=bf16-weights"),
    ("tf32", "cpu", None, ("infer",), "use amp=off on CPU"),
    ("tf32", "cuda", (7, 0), ("infer",), "this GPU has 7.0: use amp=fp16 or amp=off"),
    ("bf16-weights", "cuda", (7, 5), ("infer",), "this GPU has 7.5: use amp=fp16-weights"),
    ("int8", "cpu", None, ("infer",), "use one of off, tf32"),
])
def test_refusals_are_one_line_naming_the_fix(amp, device, capability, tasks, needle):
    with pytest.raises(VitregError) as err:
        resolve_precision(amp, device, tasks, capability)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_fp8_without_torchao_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao -> ImportError
    with pytest.raises(VitregError, match="pip install torchao"):
        resolve_precision("fp8", "cuda", capability=(9, 0))


def test_mfu_is_measured_against_the_units_that_ran(monkeypatch):
    h200 = PROFILES["h200"]
    assert resolve_precision("tf32", "cuda", capability=(9, 0)).mfu(494.7 / 2, h200) == pytest.approx(0.5)
    assert resolve_precision("bf16-weights", "cpu").mfu(989.4 / 4, h200) == pytest.approx(0.25)
    assert resolve_precision("off", "cpu").mfu(66.9, h200) == pytest.approx(1.0)
    assert resolve_precision("bf16", "cpu").mfu(1.0, PROFILES["cpu"]) is None
    monkeypatch.setitem(sys.modules, "torchao", type(sys)("torchao"))
    monkeypatch.setitem(sys.modules, "torchao.quantization", type(sys)("torchao.quantization"))
    # FP8 against the FP8 dense peak (1,978.9 TFLOP/s on an H200); a GPU profile without one gives none
    assert resolve_precision("fp8", "cuda", capability=(9, 0)).mfu(1978.9 / 4, h200) == pytest.approx(0.25)
    assert resolve_precision("fp8", "cuda", capability=(9, 0)).mfu(500.0, PROFILES["a100"]) is None


def _tf32_state():
    return (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32)


def test_tf32_is_on_inside_the_run_and_restored_after_even_on_error():
    before = _tf32_state()
    torch.set_float32_matmul_precision("medium")
    torch.backends.cudnn.allow_tf32 = False
    try:
        with pytest.raises(RuntimeError), math_mode(resolve_precision("tf32", "cuda", capability=(8, 0))):
            assert _tf32_state() == ("high", True, True)
            raise RuntimeError("the run failed")
        assert _tf32_state() == ("medium", True, False)
        with math_mode(resolve_precision("off", "cpu")):  # strict, whatever the caller had switched on
            assert _tf32_state()[:2] == ("highest", False)
        assert _tf32_state() == ("medium", True, False)
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cudnn.allow_tf32 = before[2]


@pytest.mark.slow
def test_a_mode_that_needs_no_change_leaves_torchs_defaults_untouched():
    # torch records an explicit "highest" differently from its untouched default ("none" per backend),
    # and inductor's CPU code generation tells them apart: a fresh process shows the difference.
    code = ("import torch\nfrom vitreg.hardware.precision import math_mode, resolve_precision\n"
            "with math_mode(resolve_precision('bf16', 'cpu')):\n"
            "    print(torch.backends.mkldnn.matmul.fp32_precision, torch.backends.cuda.matmul.fp32_precision)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["none", "none"]


def test_weights_cast_runs_without_autocast_in_that_dtype():
    precision = resolve_precision("bf16-weights", "cpu")
    model = prepare_model(tiny_vit(), precision)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    x = torch.randn(2, 3, 32, 32, dtype=input_dtype(precision))
    with torch.inference_mode(), autocast(precision, "cpu"):
        assert not torch.is_autocast_enabled("cpu")
        assert model(x).dtype == torch.bfloat16


def test_autocast_keeps_fp32_weights_and_computes_in_bf16():
    precision = resolve_precision("bf16", "cpu")
    model = prepare_model(tiny_vit(), precision)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert input_dtype(precision) == torch.float32
    with torch.inference_mode(), autocast(precision, "cpu"):
        assert model(torch.randn(2, 3, 32, 32)).dtype == torch.bfloat16


def test_every_choice_resolves_or_refuses_cleanly_on_cpu():
    for amp in PRECISION_CHOICES:
        try:
            resolve_precision(amp, "cpu")
        except VitregError as err:
            assert (amp == "tf32" or amp.startswith("fp8")) and "\n" not in str(err)


# The independent loop's runs, all in one Python process: each run is the real script run as
# ``__main__`` (runpy), with its own argv, stdout, stderr and exit status. A process of its own per run
# cost ~5 s of CPU each, for importing torch and timm again.
_ONE_PROCESS = """
import contextlib, io, json, runpy, sys, traceback
script, runs, results = sys.argv[1], json.loads(sys.argv[2]), []
for argv in runs:
    sys.argv, out, err, status = [script, *argv], io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:  # sys.exit("message"): Python prints the message and exits 1
            print(exc.code, file=sys.stderr) if isinstance(exc.code, str) else None
            status = 1 if isinstance(exc.code, str) else (exc.code or 0)
        except Exception:  # an uncaught error: its traceback on stderr, exit 1
            traceback.print_exc()
            status = 1
    results.append({"returncode": status, "stdout": out.getvalue(), "stderr": err.getvalue()})
print(json.dumps(results))
"""
TINY_LOOP = ["--device", "cpu", "--model", "test_vit", "--img-size", "32", "--batch-size", "4", "--warmup", "1",
             "--iters", "2", "--repeats", "2"]
NEW_MODES = [["--amp", "bf16-weights", "--sdpa", "math"], ["--amp", "off", "--sdpa", "flash"],
             ["--amp", "bf16", "--task", "train"]]
REFUSED = [["--amp", "fp16-weights", "--task", "train"], ["--amp", "off", "--sdpa", "efficient"],
           ["--amp", "fp8", "--task", "train"]]


@pytest.fixture(scope="module")
def independent_runs():
    """``{tuple(args): SimpleNamespace(returncode, stdout, stderr)}`` for every configuration below."""
    from types import SimpleNamespace

    configs = NEW_MODES + REFUSED
    done = subprocess.run([sys.executable, "-c", _ONE_PROCESS, str(REPO / "benchmarks" / "independent_check.py"),
                           json.dumps([TINY_LOOP + args for args in configs])],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    return {tuple(args): SimpleNamespace(**result) for args, result in zip(configs, results)}


@pytest.mark.slow
@pytest.mark.parametrize("args", NEW_MODES)
def test_independent_loop_runs_the_new_modes(independent_runs, args):
    done = independent_runs[tuple(args)]
    assert done.returncode == 0, done.stderr
    line = json.loads(done.stdout.strip().splitlines()[-1])
    assert line["check"] == "independent" and line["img_per_s_median"] > 0 and line["gpu"] == "cpu"
    assert line["amp"] == args[1] and line["sdpa"] == (args[3] if args[2] == "--sdpa" else "auto")


@pytest.mark.slow
def test_independent_loop_refuses_what_it_cannot_run(independent_runs):
    assert "inference only" in independent_runs[tuple(REFUSED[0])].stderr
    done = independent_runs[tuple(REFUSED[1])]  # no CPU kernel: torch's own error
    assert done.returncode != 0 and "No viable backend" in done.stderr
    if importlib.util.find_spec("torchao") is None:  # float8 training is torchao's (an optional extra)
        done = independent_runs[tuple(REFUSED[2])]
        assert done.returncode == 1 and "--amp fp8 needs torchao: pip install torchao" in done.stderr


def test_fp8_agreement_compares_top1_and_the_largest_logit_difference_on_a_fixed_batch():
    import copy

    import timm

    from vitreg.hardware.precision import fp8_agreement

    torch.manual_seed(0)
    model = timm.create_model("test_vit", pretrained=False, img_size=32).to(torch.bfloat16)
    same = fp8_agreement(model, copy.deepcopy(model), 32, torch.device("cpu"), batch=16)
    assert (same.top1_agreement, same.max_abs_logit_diff) == (1.0, 0.0)
    moved = copy.deepcopy(model)
    with torch.no_grad():
        moved.head.bias.add_(torch.linspace(0, 5, moved.head.bias.numel(), dtype=torch.bfloat16))
    apart = fp8_agreement(model, moved, 32, torch.device("cpu"), batch=16)
    assert apart.max_abs_logit_diff == pytest.approx(5.0, rel=0.05) and apart.top1_agreement < 1.0
    assert fp8_agreement(model, moved, 32, torch.device("cpu"), batch=16) == apart  # the same fixed batch
