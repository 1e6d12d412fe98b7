"""Property: whatever string any option of `bench`, `infer` or `train` gets, the command exits 0, or
exits 2 with one `error:` line; never a traceback, never a run left RUNNING.

Each example fuzzes one option (valid choices, near misses, garbage, huge and negative numbers, empty
strings, unicode) on a cheap base command (test_vit, 32 px, one step, CPU) against a real sqlite
store, in-process through click. The knobs that make a valid run long or huge (steps, repeats,
compile, nproc, a bench batch, ...) get only small valid values besides their invalid ones: the
property is about parsing and refusing, not about waiting for a big run to finish.
"""

from __future__ import annotations

import os

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from click.testing import CliRunner  # noqa: E402

from vitreg.cli.main import main  # noqa: E402
from vitreg.config.options import options_of  # noqa: E402

#: sized for < 60 s on a CPU; VITREG_FUZZ_EXAMPLES=500 hunts longer
EXAMPLES = int(os.environ.get("VITREG_FUZZ_EXAMPLES", "50"))
BASE = {
    "bench": ["bench", "--model", "test_vit", "--img-size", "32", "--batch-size", "2", "--warmup", "1", "--steps", "1",
              "--repeats", "1", "--device", "cpu", "--task", "infer"],
    "train": ["train", "--model", "test_vit", "--img-size", "32", "--batch-size", "2", "--steps", "1",
              "--num-classes", "10", "--num-workers", "0", "--device", "cpu", "--log-every", "1",
              "--checkpoint-every", "0"],
    "infer": ["infer", "--batch-size", "2", "--warmup", "1", "--steps", "1", "--repeats", "1", "--device", "cpu"],
}
GARBAGE = ["", " ", "nan", "inf", "-inf", "-1", "-0", "0", "1e309", "1.5", "0x10", "١٢", "ｔｒｕｅ", "true", "None",
           "null", "--steps", "../../etc/passwd", "models:/", "runs:/", "a" * 300, "💥", "\t", "1_000", "+3",
           "9" * 40, "-" + "9" * 40]
#: valid values allowed for the knobs that would make a valid run long, huge or multi-process
SMALL = {
    "steps": ["1", "2"], "repeats": ["1", "2"], "warmup": ["1", "2"], "img_size": ["0", "16", "32", "48"],
    "nproc": ["1"], "profile_steps": ["0", "1"], "num_workers": ["0", "1"], "compile": ["off", "OFF"],
    "num_classes": ["0", "2", "10"], "nnodes": ["1"], "model": ["test_vit", "test_vit2", " test_vit "],
    "data": ["synthetic", "SYNTHETIC"], "epochs": ["0", "1"],
}
#: huge values that must be refused before anything runs (by the memory floors)
REFUSED_HUGE = {"img_size": ["1000000", "10000000000"], "num_classes": ["10000000000"]}
BATCH = {"bench": ["1", "2"], "infer": ["1", "2"], "train": ["1", "2", "1000000000"]}  # train refuses a huge batch


def _near_misses(choices):
    return [c.upper() for c in choices] + [c[:-1] for c in choices] + [c + "x" for c in choices]


def _values(command: str, option) -> st.SearchStrategy:
    garbage = st.one_of(st.sampled_from(GARBAGE), st.text(max_size=8))
    if option.name == "batch_size":
        return st.one_of(st.sampled_from(BATCH[command]), st.integers(-10**6, 0).map(str), garbage)
    if option.name in SMALL:
        valid = SMALL[option.name] + REFUSED_HUGE.get(option.name, [])
        return st.one_of(st.sampled_from(valid), st.integers(-10**12, -1).map(str), garbage)
    if option.kind == "choice":
        return st.one_of(st.sampled_from(option.choices), st.sampled_from(_near_misses(option.choices)), garbage)
    if option.kind == "int":
        return st.one_of(st.integers(-10**15, 10**15).map(str), garbage)
    if option.kind == "float":
        return st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr), st.integers().map(str), garbage)
    if option.kind == "bool":
        return st.one_of(st.sampled_from(["true", "false", "yes", "no", "1", "0", "on", "TRUE", "maybe"]), garbage)
    return garbage


#: options whose valid values start work that waits on something outside (a rendezvous peer)
NOT_FUZZED = {"rdzv_endpoint"}


def _fuzzable(command: str):
    return [o for o in options_of(command) if o.name not in NOT_FUZZED and (command != "infer" or o.name != "model_uri")]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """infer's --model-uri: a real test_vit checkpoint (fuzzed too, with garbage instead of it)."""
    from vitreg.config.spec import TrainSpec
    from vitreg.models.factory import create_model
    from vitreg.checkpoint import format as ckpt

    model, info = create_model("test_vit", 32, 10)
    spec = TrainSpec(model="test_vit", img_size=32, num_classes=10, steps=1).to_params()
    return ckpt.save_checkpoint(tmp_path_factory.mktemp("fuzz") / "step-1", model, step=1, spec=spec, model_info=info)


def _check_outcome(res, argv):
    from mlflow.tracking import MlflowClient

    shown = f"{argv!r}\n{res.output[-2000:]}"
    assert res.exit_code in (0, 2), f"exit {res.exit_code} ({res.exception!r}) for {shown}"
    assert "Traceback" not in res.output, shown
    if res.exit_code == 2:
        errors = [line for line in res.output.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, shown
    client = MlflowClient()
    running = [r.info.run_id for r in client.search_runs([e.experiment_id for e in client.search_experiments()],
                                                         filter_string="attributes.status = 'RUNNING'")]
    assert not running, f"runs left RUNNING {running} by {shown}"


@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_every_option_value_ends_in_success_or_one_error_line(sqlite_store, tiny_checkpoint, data):
    command = data.draw(st.sampled_from(sorted(BASE)), label="command")
    option = data.draw(st.sampled_from(_fuzzable(command)), label="option")
    value = data.draw(_values(command, option), label="value")
    argv = list(BASE[command])
    if command == "infer":
        argv += ["--model-uri", str(tiny_checkpoint)]
    argv.append(f"{option.flags[0]}={value}")  # `--name=value`: a value starting with '-' stays a value
    res = CliRunner().invoke(main, argv)
    _check_outcome(res, argv)


@pytest.mark.slow
@settings(max_examples=8, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(value=st.one_of(st.sampled_from(GARBAGE), st.text(max_size=12)))
def test_every_model_uri_ends_in_success_or_one_error_line(sqlite_store, value):
    argv = [*BASE["infer"], f"--model-uri={value}"]
    _check_outcome(CliRunner().invoke(main, argv), argv)
