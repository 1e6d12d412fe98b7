"""vitreg sweep's axes and bad input, against a real sqlite store: every refusal is one line, exit 2, and no run
(parent or child) is made; labels come from the identity options that vary."""

from __future__ import annotations


import pytest
from click.testing import CliRunner

from conftest import free_port
from vitreg.cli.main import main
from vitreg.fleet.axes import axis_texts_of, collect_axes, plan

BASE = ["sweep", "--models", "test_vit", "--experiment", "sw", "--device", "cpu"]


def _runs(name):
    from mlflow.tracking import MlflowClient

    exp = MlflowClient().get_experiment_by_name(name)
    return [] if exp is None else MlflowClient().search_runs([exp.experiment_id])


@pytest.mark.parametrize("args, needle", [
    (["--axis", "experiment=a,b"], "experiment cannot vary within one sweep"),
    (["--axis", "engine=local,ray"], "engine is an option of the sweep itself"),
    (["--axis", "sdpx=auto,math"], "unknown axis 'sdpx': did you mean sdpa?"),
    (["--axis", "sdpa=auto,nope"], "sdpa='nope' is not one of"),
    (["--axis", "nproc=1,zero"], "nproc='zero' is not an integer"),
    (["--axis", "sdpa"], "is not NAME=V1,V2"),
    (["--models", "test_vit,,test_vit"], "models lists 'test_vit' twice"),  # issue 45's trial
    (["--max-parallel", "0"], "max_parallel=0 must be >= 1"),
    (["--gpu", "h100,a100"], "use engine=ray on a cluster that has them"),
    (["--axis", "amp=off,bf16", "--amp", "off"], "amp is given twice"),
    (["--axis", "seed=0,1,2,3", "--batch-size", "1,2,3,4,5", "--max-combinations", "19"],
     "the sweep has 20 combinations, more than max_combinations=19"),
    (["--engine", "ray", "--ray-address", "nohost.invalid:1"], "the Ray cluster at nohost.invalid:1 does not answer"),
])
def test_bad_sweep_is_one_line_and_starts_nothing(sqlite_store, args, needle):
    result = CliRunner().invoke(main, [*BASE, *args])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], result.output
    assert "Traceback" not in result.output
    assert _runs("sw") == []


def test_empty_models_suggests_models(sqlite_store):
    """Issue 20: `sweep models=''` suggested `models=off,bf16` (amp's example)."""
    result = CliRunner().invoke(main, ["sweep", "--models", "", "--experiment", "sw"])
    assert result.exit_code == 2
    assert "--models deit_tiny_patch16_224," in result.output and "off,bf16" not in result.output


def test_a_ray_address_that_does_not_answer_is_refused_after_one_connect(sqlite_store, monkeypatch, ports_tried):
    import ray

    joined = []
    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: joined.append(kwargs))
    port = free_port()  # nothing listens there
    result = CliRunner().invoke(main, [*BASE, "--engine", "ray", "--ray-address", f"ray://127.0.0.1:{port}"])
    assert result.exit_code == 2 and f"the Ray cluster at ray://127.0.0.1:{port} does not answer" in result.output
    # one TCP connect, refused at once, and Ray's client (which keeps trying for minutes) never started
    assert [p for _, p in ports_tried].count(port) == 1 and joined == []


def test_a_closed_ray_address_in_ray_address_is_refused_after_one_connect_naming_it(sqlite_store, monkeypatch,
                                                                                    ports_tried):
    """Issue 40: ray_address=auto defers to RAY_ADDRESS, as Ray does; that address went unchecked to ray.init,
    which waited 60 s and more on a closed port, saying nothing on the console."""
    import ray

    joined = []
    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: joined.append(kwargs))
    port = free_port()  # nothing listens there
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    result = CliRunner().invoke(main, [*BASE, "--engine", "ray"])
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1, result.output
    assert f"the Ray cluster at 127.0.0.1:{port} (RAY_ADDRESS) does not answer" in errors[0]
    assert [p for _, p in ports_tried].count(port) == 1 and joined == []


def test_a_ray_sweep_ships_vitreg_with_its_commit_and_adds_ray_runtime_env_or_refuses_it(sqlite_store, monkeypatch,
                                                                                        tmp_path):
    """Issue 40: the Ray job's runtime_env ships this vitreg package (py_modules) and its commit, after whatever
    ray_runtime_env adds; a ray_runtime_env that is not one is one error line before Ray is joined."""
    import json
    from pathlib import Path

    import ray

    import vitreg
    from vitreg.environment import git_sha
    from vitreg.fleet.ray_engine import shipped_env

    env = shipped_env({"pip": ["timm"], "py_modules": [str(tmp_path)], "env_vars": {"A": "1"}})
    assert env["py_modules"] == [str(tmp_path), str(Path(vitreg.__file__).resolve().parent)] and env["pip"] == ["timm"]
    assert env["env_vars"] == {"A": "1", "VITREG_GIT_SHA": git_sha()} and "__pycache__" in env["excludes"]
    joined = []
    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: joined.append(kwargs))
    for bad, needle in [("{pip: timm}", "ray_runtime_env: not valid JSON"), ('["timm"]', "must be a JSON object"),
                        ('{"pip": 3}', "is not a runtime_env Ray takes"), ('{"py_modules": "/"}', "Ray takes"),
                        ('{"py_modules": ["/no/such"]}', "is not a runtime_env Ray takes")]:
        result = CliRunner().invoke(main, [*BASE, "--engine", "ray", "--ray-address", f"127.0.0.1:{free_port()}",
                                           "--ray-runtime-env", bad])
        errors = [line for line in result.output.splitlines() if line.startswith("error:")]
        assert result.exit_code == 2 and len(errors) == 1 and needle in errors[0], result.output
    assert joined == []


def test_a_cpu_child_of_a_type_no_ray_node_has_is_told_the_types_not_to_pass_the_device_it_gave():
    """Issue 40 item 7: `--gpu a100 --device cpu` said "asks for 0 GPUs of type A100 ...: pass device=cpu"."""
    from vitreg.errors import VitregError
    from vitreg.fleet.axes import Combination
    from vitreg.fleet.ray_engine import RayEngine

    engine = RayEngine.__new__(RayEngine)  # no cluster: one node of type H100, as ray.nodes() shows it
    engine._nodes = lambda: [{"Alive": True, "Resources": {"CPU": 2.0, "GPU": 1.0, "accelerator_type:H100": 1.0}}]
    with pytest.raises(VitregError) as refused:
        engine.check([Combination((("model", "test_vit"),), "test_vit")], {"gpu": "a100", "device": "cpu"})
    assert "gpu=a100: no node of the Ray cluster has accelerator type A100 (it has: H100)" in str(refused.value)
    assert "device=cpu" not in str(refused.value)


def test_a_ray_cpu_child_reserves_its_nodes_every_cpu_unless_share_node_and_a_gpu_child_only_its_gpus():
    """Issue 40 item 4: a CPU child reserved one CPU, so two timed side by side on one node's CPU. Now it asks for
    the most CPUs a node of its type has (no other child fits beside it); a GPU child its GPUs and one CPU, so an
    8-GPU node still runs 8 children at once, each on its own GPU; share_node=true: one CPU, as before."""
    from vitreg.fleet.axes import Combination
    from vitreg.fleet.ray_engine import RayEngine

    engine = RayEngine.__new__(RayEngine)  # no cluster: two H100 nodes of 16 and 32 CPUs, a CPU node of 64
    engine._nodes = lambda: [{"Alive": True, "Resources": {"CPU": cpus, **gpus}} for cpus, gpus in [
        (16.0, {"GPU": 8.0, "accelerator_type:H100": 1.0}), (32.0, {"GPU": 8.0, "accelerator_type:H100": 1.0}),
        (64.0, {})]]
    child = Combination((("model", "test_vit"),), "test_vit")
    on_h100 = {"gpu": "h100", "device": "cpu"}
    assert engine.task_options(child, on_h100) == {"num_cpus": 32, "num_gpus": 0, "accelerator_type": "H100"}
    assert engine.task_options(child, {"device": "cpu"})["num_cpus"] == 64
    assert engine.task_options(child, {"gpu": "h100", "nproc": 2}) == {"num_cpus": 1, "num_gpus": 2,
                                                                       "accelerator_type": "H100"}
    engine.share_node = True
    assert engine.task_options(child, on_h100) == {"num_cpus": 1, "num_gpus": 0, "accelerator_type": "H100"}


def test_compare_says_which_figures_may_have_shared_their_node():
    """A cluster child of a sweep given share_node=true is tagged sweep_shared_node; compare's table says so."""
    import pandas as pd

    from vitreg.analysis.comparison import compare_gpus
    from vitreg.analysis.render import format_table
    from vitreg.tracking.search import tidy

    runs = pd.DataFrame([{"run_id": f"r{i}", "status": "FINISHED", "params.model": "test_vit", "params.task": "infer",
                          "tags.gpu": gpu, "params.gpu": gpu, "params.batch_size": "2", "params.amp": "off",
                          "params.compile": "off", "metrics.infer_throughput_img_per_s": 100.0 + i,
                          **({"tags.sweep_shared_node": "true"} if shared else {})}
                         for i, (gpu, shared) in enumerate([("h100", True), ("h100", False), ("a100", True)])])
    comparison = compare_gpus(tidy(runs), baseline=None)
    assert comparison.table.set_index("gpu")["shared_node"].to_dict() == {"a100": "yes", "h100": "1/2"}
    assert "shared node" in format_table(comparison)
    alone = runs.drop(columns="tags.sweep_shared_node")
    assert "shared node" not in format_table(compare_gpus(tidy(alone), baseline=None))


def test_axes_param_and_axis_flags_make_one_product():
    common = {"device": "cpu", "img_size": 32, "gpu": "auto"}
    axes = collect_axes({"models": "test_vit,test_vit2", "amp": "off", "compile": "off", "batch_size": "2"},
                        axis_texts_of(("sdpa=auto,math;seed=0,1", "nproc=1")), common)
    combos = plan(axes, common)
    assert len(combos) == 2 * 2 * 2
    # the label names the identity options that vary (model, sdpa), never seed (the same work) unless needed
    labels = {c.label for c in combos}
    assert "test_vit-sdpa=math-seed=1" in labels and len(labels) == 8
    axes = collect_axes({"models": "test_vit,test_vit2", "amp": "off", "compile": "off", "batch_size": "2"},
                        axis_texts_of("sdpa=auto,math"), dict(common))
    assert {c.label for c in plan(axes, dict(common))} == {"test_vit-sdpa=auto", "test_vit-sdpa=math",
                                                            "test_vit2-sdpa=auto", "test_vit2-sdpa=math"}


def test_the_mlproject_axes_param_reaches_the_sweep(sqlite_store):
    """`-P axes="a=..;b=.."` arrives as one `--axes` text: each of its axes is checked (here the second)."""
    result = CliRunner().invoke(main, [*BASE, "--axes", "sdpa=auto,math;img_size=32,x"])
    assert result.exit_code == 2 and "img_size='x' is not an integer" in result.output, result.output


def test_compare_shows_how_many_children_shared_a_host():
    """engine=local tags each child with the children that shared its host; compare's table shows it."""
    import pandas as pd

    from vitreg.analysis.comparison import compare_gpus
    from vitreg.analysis.render import format_table
    from vitreg.tracking.search import tidy

    runs = pd.DataFrame([{"run_id": f"r{i}", "status": "FINISHED", "params.model": "test_vit", "params.task": "infer",
                          "tags.gpu": gpu, "params.gpu": gpu, "params.batch_size": "2", "params.amp": "off",
                          "params.compile": "off", "metrics.infer_throughput_img_per_s": 100.0 + i,
                          "tags.sweep_children_on_host": shared}
                         for i, (gpu, shared) in enumerate([("h100", "1"), ("h100", "1"), ("a100", "4")])])
    comparison = compare_gpus(tidy(runs), baseline=None)
    assert comparison.table.set_index("gpu")["shared_host"].to_dict() == {"a100": 4.0, "h100": 1.0}
    assert "shared host" in format_table(comparison)
    alone = runs.assign(**{"tags.sweep_children_on_host": "1"})
    assert "shared host" not in format_table(compare_gpus(tidy(alone), baseline=None))


def test_rerun_failed_of_a_run_that_is_no_ended_sweep_is_one_line(sqlite_store):
    """`--rerun-failed` reads the parent first: an unknown id, a run that is not a sweep's parent, and a sweep
    still RUNNING (its process may still start children) are refused, each in one line, and nothing runs."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    exp = client.create_experiment("sw")
    plain = client.create_run(exp).info.run_id
    client.set_terminated(plain, "FAILED")
    running = client.create_run(exp, tags={"vitreg_job": "sweep"}).info.run_id
    for run_id, needle in [("0123abcd", "no run '0123abcd' at"), (plain, f"run {plain} is not a sweep's parent run"),
                           (running, f"sweep {running} is still RUNNING")]:
        result = CliRunner().invoke(main, ["sweep", "--rerun-failed", run_id])
        assert result.exit_code == 2, result.output
        errors = [line for line in result.output.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and needle in errors[0], result.output
    assert len(_runs("sw")) == 2


def test_bad_days_v_case_8_rerun_failed_refuses_new_work_options_by_name(sqlite_store):
    """Issue 45, case 8: `--rerun-failed <id> --batch-size 64 --models vit_huge_patch14_224` (and `--repeats 2`)
    re-ran with the parent's options and said nothing. A re-run runs each combination as it was started: an axis
    or bench option given with it is refused by its flag (the engine's options still win), and nothing runs."""
    import json

    from mlflow.tracking import MlflowClient

    from vitreg.bench.sweep import COMBINATIONS_FILE

    client = MlflowClient()
    exp = client.create_experiment("sw")
    parent = client.create_run(exp, tags={"vitreg_job": "sweep", "sweep_engine": "local"}).info.run_id
    client.log_text(parent, json.dumps({"common": {"device": "cpu"}, "combinations": [
        {"label": "test_vit", "options": {"model": "test_vit", "batch_size": 2}}]}), COMBINATIONS_FILE)
    client.set_terminated(parent, "FAILED")  # its one combination never got a child
    for given, flags in [(["--batch-size", "64", "--models", "vit_huge_patch14_224"], "--models, --batch-size"),
                         (["--repeats", "2"], "--repeats"), (["--axis", "sdpa=math", "--img-size", "64"],
                                                             "--axes, --img-size")]:
        result = CliRunner().invoke(main, ["sweep", "--rerun-failed", parent, *given])
        errors = [line for line in result.output.splitlines() if line.startswith("error:")]
        assert result.exit_code == 2 and len(errors) == 1, result.output
        assert f"so {flags} would not apply: leave" in errors[0] and "start a new sweep" in errors[0], errors
    assert len(_runs("sw")) == 1


def test_the_time_left_counts_the_typical_child_not_the_first_ones_wait_for_its_worker():
    """Issue 35: "about 3 min left" after the first child, then six more minutes. A GPU's first child also waits
    for its warm worker's imports; the later ones are what the rest will take."""
    from vitreg.fleet.board import Board

    lines = []
    board = Board(1, lines.append)
    for _ in range(6):
        board.queued("h200")
    for seconds in (20.0, 2.0, 3.0):
        board.started("h200")
        board.ended("h200", True, seconds)
    assert lines[-1].endswith("; about 9 s left"), lines[-1]  # 3 left x the median 3 s (the mean would say 25 s)


@pytest.mark.parametrize("recorded", ["settings", "engine tag only"])
def test_rerun_failed_of_a_ray_sweep_reruns_on_ray_at_its_address(sqlite_store, monkeypatch, recorded):
    """Issue 40: `--rerun-failed` of a Ray parent ran its failed child on this host's CPU. It re-runs on the
    parent's engine: at the address its sweep_settings tag records, or (a parent of an older vitreg, tagged
    sweep_engine=ray alone) at Ray's own default, RAY_ADDRESS. Both addresses are closed: the refusal names it."""
    import json

    import ray
    from mlflow.tracking import MlflowClient

    from vitreg.bench.sweep import OPTIONS_TAG, SETTINGS_TAG

    joined = []
    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: joined.append(kwargs))
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    tags = {"vitreg_job": "sweep", "sweep_engine": "ray"}
    if recorded == "settings":
        tags[SETTINGS_TAG] = json.dumps({"engine": "ray", "ray_address": address})
    else:
        monkeypatch.setenv("RAY_ADDRESS", address)
    client = MlflowClient()
    exp = client.create_experiment("sw")
    parent = client.create_run(exp, tags=tags).info.run_id
    options = {"common": {"device": "cpu", "img_size": 32}, "combination": {"model": "test_vit", "batch_size": 2}}
    child = client.create_run(exp, tags={"mlflow.parentRunId": parent, "sweep_index": "1", "sweep_label": "test_vit",
                                         "sweep_engine": "ray", OPTIONS_TAG: json.dumps(options)}).info.run_id
    for run_id in (child, parent):
        client.set_terminated(run_id, "FAILED")
    result = CliRunner().invoke(main, ["sweep", "--rerun-failed", parent])
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1, result.output
    assert f"the Ray cluster at {address}" in errors[0] and joined == [], errors
    assert len(_runs("sw")) == 2


def test_the_sweeps_table_flags_the_row_of_a_child_measured_on_a_busy_host(sqlite_store, capsys):
    """Issue 38: a sweep child measured beside other load (2.73 img/s against 9.44 alone) was printed in the
    sweep's table without a word. The table the sweep prints at its end carries the flag on that child's row,
    and only there; a configuration with several runs says how many of them are suspect."""
    from mlflow.tracking import MlflowClient

    from vitreg.bench import sweep
    from vitreg.fleet import children
    from vitreg.tracking import runs as tracking

    client = MlflowClient()
    with tracking.tracked_run(run_name="sweep", experiment="sw-flags", system_metrics=False) as parent:
        # the children as a CPU bench logs them (params, the window tags, the figure), batch 4 beside other load
        for i, (bs, img_s, busy) in enumerate([(2, 9.44, "false"), (4, 2.73, "true"), (8, 9.1, "false"),
                                               (8, 3.0, "true"), (8, 9.3, "false")]):
            child = tracking.create_child_run(parent, f"batch_size={bs}", {
                "gpu": "cpu", "amp": "off", "img_size": "32", "infer_busy_host": busy,
                "infer_host_load_beside_run": "1.65" if busy == "true" else "0.02", children.HOST_SHARE_TAG: "1"})
            for key, value in {"model": "test_vit", "task": "infer", "batch_size": bs, "amp": "off",
                               "compile": "off", "gpu": "cpu", "img_size": 32}.items():
                client.log_param(child, key, value)
            client.log_metric(child, "infer_throughput_img_per_s", img_s)
            client.set_terminated(child, "FINISHED")
        sweep._log_comparison(parent)
    lines = capsys.readouterr().out.splitlines()
    header = next((line for line in lines if line.split()[:2] == ["model", "batch"]), "")
    assert header.rstrip().endswith("flags"), lines
    rows = {line.split()[1]: line.rstrip() for line in lines if line.startswith("test_vit ")}  # by batch
    assert rows["4"].endswith("busy host") and "2.73" in rows["4"], rows
    assert rows["8"].endswith("busy host 1/3"), rows
    assert rows["2"].endswith("-") and "busy" not in rows["2"], rows


# ----------------------------------------------------------------- issue 45: --ray-runtime-env's secrets and sizes
SECRET_ENV = {"HF_TOKEN": "hf_SUPERSECRET1234", "AWS_SECRET_ACCESS_KEY": "aws/SECRET+key9"}


def _ray_sweep(*args, address=None):
    return CliRunner().invoke(main, [*BASE, "--engine", "ray", "--ray-address", address or f"127.0.0.1:{free_port()}",
                                     *args])


def _error_line(result) -> str:
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1 and "Traceback" not in result.output, result.output
    return errors[0]


def test_bad_days_v_case1_a_runtime_env_ray_refuses_is_one_line_without_its_secrets(sqlite_store, monkeypatch):
    """`{"env_vars": {"HF_TOKEN": ...}, "pip": 5}` was refused with the whole JSON, token included, echoed."""
    import json

    import ray

    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: None)
    for bad in (json.dumps({"env_vars": SECRET_ENV, "pip": 5}), json.dumps({"env_vars": SECRET_ENV}) + "}"):
        result = _ray_sweep("--ray-runtime-env", bad)
        line = _error_line(result)
        assert "ray_runtime_env" in line and not any(v in result.output for v in SECRET_ENV.values()), result.output
    assert _runs("sw") == []


class _RecordingRay:
    """RayEngine's stand-in: it keeps the runtime_env it was given and runs no child."""

    given: list = []
    slots, where = 1, "a stand-in cluster"

    def __init__(self, address, max_parallel, progress, share_node=False, device="auto", runtime_env=None):
        self.given.append(runtime_env)

    def expand_gpus(self, axes):
        pass

    def check(self, combos, common):
        pass

    def run(self, ctx, combos):
        pass

    def close(self):
        pass


def _every_record(run_id) -> str:
    """Every tag, param and artifact of a run, as one text."""
    from pathlib import Path

    from mlflow.tracking import MlflowClient

    run = MlflowClient().get_run(run_id)
    folder = Path(MlflowClient().download_artifacts(run_id, ""))
    files = [p.read_text(errors="replace") for p in folder.rglob("*") if p.is_file()]
    return "\n".join([*map(str, run.data.tags.values()), *map(str, run.data.params.values()), *files])


def test_bad_days_v_case2_runtime_env_secrets_are_never_stored_and_a_rerun_reads_them_here(sqlite_store,
                                                                                          monkeypatch):
    """The parent's sweep_settings tag held env_vars values in clear text. They are masked in every record; a
    re-run takes each from this process's environment, or refuses in one line naming it."""
    import json

    from mlflow.tracking import MlflowClient

    from vitreg.bench.sweep import SETTINGS_TAG
    from vitreg.fleet import ray_engine

    monkeypatch.setattr(ray_engine, "RayEngine", _RecordingRay)
    _RecordingRay.given.clear()
    env = json.dumps({"env_vars": SECRET_ENV, "pip": ["timm"]})
    result = _ray_sweep("--ray-runtime-env", env)
    assert result.exit_code == 0 and not any(v in result.output for v in SECRET_ENV.values()), result.output
    assert _RecordingRay.given[-1]["env_vars"] == SECRET_ENV  # Ray itself gets them
    (parent,) = _runs("sw")
    records = _every_record(parent.info.run_id)
    assert not any(v in records for v in SECRET_ENV.values())
    recorded = json.loads(json.loads(parent.data.tags[SETTINGS_TAG])["ray_runtime_env"])
    assert recorded == {"env_vars": dict.fromkeys(SECRET_ENV, "***"), "pip": ["timm"]}
    for name in SECRET_ENV:
        monkeypatch.delenv(name, raising=False)
    again = CliRunner().invoke(main, ["sweep", "--rerun-failed", parent.info.run_id])
    assert "export HF_TOKEN=" in _error_line(again) and "hf_SUPER" not in again.output
    for name, value in SECRET_ENV.items():
        monkeypatch.setenv(name, value)
    again = CliRunner().invoke(main, ["sweep", "--rerun-failed", parent.info.run_id])
    assert _RecordingRay.given[-1] == {"env_vars": SECRET_ENV, "pip": ["timm"]}, again.output
    assert MlflowClient().get_run(parent.info.run_id).data.tags[SETTINGS_TAG] == parent.data.tags[SETTINGS_TAG]


def test_bad_days_v_case3_a_huge_malformed_runtime_env_is_refused_in_a_short_line(sqlite_store):
    """A malformed 125 KB JSON made a 125,149-byte "one-line" error. Any value is quoted at most in part."""
    from vitreg.errors import VitregError

    result = _ray_sweep("--ray-runtime-env", '{"pip": [' + '"timm", ' * 15_000)
    assert len(_error_line(result)) < 400
    assert len(str(VitregError("batch_size=" + "9" * 125_000 + " is not an integer"))) < 200


def test_bad_days_v_case4_a_runtime_env_too_long_to_record_is_refused_up_front(sqlite_store, monkeypatch):
    """A valid 18.5 KB runtime_env was cut in the sweep_settings tag, and `--rerun-failed` then died of a
    JSONDecodeError. It is refused before anything runs, naming the limit; a parent whose tag an older vitreg cut
    is refused in one line."""
    import json

    from mlflow.tracking import MlflowClient

    from vitreg.bench.sweep import OPTIONS_TAG, SETTINGS_TAG

    packages = [f"package-number-{i}==1.0.{i}" for i in range(700)]
    result = _ray_sweep("--ray-runtime-env", json.dumps({"pip": packages}))
    assert "over 2,000" in _error_line(result) and "requirements" in result.output
    assert _runs("sw") == []
    client = MlflowClient()
    exp = client.create_experiment("sw")
    cut = json.dumps({"engine": "ray", "ray_runtime_env": json.dumps({"pip": packages})})[:8000]
    parent = client.create_run(exp, tags={"vitreg_job": "sweep", SETTINGS_TAG: cut}).info.run_id
    options = {"common": {"device": "cpu"}, "combination": {"model": "test_vit"}}
    child = client.create_run(exp, tags={"mlflow.parentRunId": parent, "sweep_index": "1",
                                         OPTIONS_TAG: json.dumps(options)}).info.run_id
    for run_id in (child, parent):
        client.set_terminated(run_id, "FAILED")
    assert "is cut short" in _error_line(CliRunner().invoke(main, ["sweep", "--rerun-failed", parent]))


def test_bad_days_v_case5_runtime_env_is_checked_on_every_engine_and_a_typo_is_named(sqlite_store, monkeypatch):
    """`--engine local --ray-runtime-env 'not json at all'` ran, storing the value for a later Ray re-run; a field
    Ray does not know (`env_var`) passed without a word."""
    import ray

    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: None)
    result = CliRunner().invoke(main, [*BASE, "--engine", "local", "--ray-runtime-env", "not json at all"])
    assert "ray_runtime_env: not valid JSON" in _error_line(result)
    assert _runs("sw") == []
    result = _ray_sweep("--ray-runtime-env", '{"env_var": {"A": "b"}}')
    assert "has a field Ray does not know, 'env_var' (did you mean 'env_vars'?)" in result.output, result.output


def test_bad_days_v_case7_a_blank_rerun_failed_is_refused(sqlite_store):
    """`--rerun-failed '   '` started a brand-new sweep."""
    result = CliRunner().invoke(main, [*BASE, "--rerun-failed", "   "])
    assert "rerun_failed=' ' is blank" in _error_line(result)
    assert _runs("sw") == []
