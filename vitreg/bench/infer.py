"""The ``infer`` job: benchmark a registered model's real weights, logged exactly like ``bench``.

options -> spec (the model and img_size come from the registered checkpoint) -> hardware ->
runtime -> pull (verified, rebuilt timm model) -> runner -> tracking; then the run and the model
version are linked both ways: the run gets ``model_uri``, ``registered_model_name`` and
``registered_model_version`` tags, the version gets ``last_infer_run_id`` and the throughput.
"""

from __future__ import annotations

import functools
import shlex
import sys
import tempfile

from vitreg.tracking import checkpoints, naming
from vitreg.tracking import runs as tracking
from vitreg.tracking.tags import log_setup, log_what_ran, resolved_tags
from vitreg.console import progress
from vitreg.hardware.env import capture_environment
from vitreg.errors import VitregError
from vitreg.hardware.profiles import detect_hardware, resolve_hardware
from vitreg.bench.report import report_markdown, results_table
from vitreg.bench.results import BenchResult
from vitreg.bench.runner import run_benchmark
from vitreg.hardware.runtime import resolve_runtime
from vitreg.config.spec import BenchSpec, parse_int

#: Options that the registered checkpoint decides, not the user.
FROM_CHECKPOINT = ("model", "img_size")


def infer(model_uri: str, options: dict, experiment: str | None = None, run_name: str | None = None,
          progress=progress, command: str | None = None) -> BenchResult:
    """Pull ``model_uri`` and benchmark it (task=infer unless ``options['task']`` says otherwise) as one run."""
    command = command or " ".join(shlex.quote(a) for a in sys.argv)
    model_uri = str(model_uri or "").strip()
    options = {"task": "infer", **{k: v for k, v in options.items() if v is not None}}
    for key in FROM_CHECKPOINT:
        if key in options:
            raise VitregError(f"{key} comes from the registered model's spec.json: drop {key}= and pass model_uri")
    if parse_int(options.get("nproc", 1), "nproc", 1) != 1:
        raise VitregError("infer benchmarks one process: pass nproc=1 (multi-GPU scaling is `bench`'s job)")
    with tracking.tracked_run(run_name=run_name, experiment=experiment) as run:
        if not model_uri:
            raise VitregError("model_uri is empty: pass e.g. model_uri=models:/deit-tiny@champion")
        # Cheap checks first (option values, GPU label), then the download.
        pre = BenchSpec.from_options({**options, "model": "pending"})
        detected = detect_hardware(pre.device)
        hw = resolve_hardware(pre.gpu, detected, pre.allow_gpu_mismatch)
        runtime = resolve_runtime(pre.amp, pre.compile, pre.compile_backend, detected)
        with tempfile.TemporaryDirectory(prefix="vitreg-infer-") as tmp:
            pulled = checkpoints.pull(model_uri, dst=tmp, progress=progress)
        info = pulled.info
        spec = BenchSpec.from_options({**options, "model": info.name, "img_size": info.img_size})
        env = capture_environment()
        short = pulled.version_uri or model_uri
        what = (f"{pulled.registered_model_name}-v{pulled.registered_model_version}" if pulled.version_uri
                else f"{info.name}-run-{(pulled.run_id or 'local')[:8]}")
        name = functools.partial(naming.run_name, hw.label, what, runtime.amp, spec.batch_size, spec.compile,
                                 cuda_graph=spec.cuda_graph, job="infer",
                                 ran_on=detected.profile.label if hw.mismatch else None)
        run.set_name(run_name or name())
        run.set_tags({**env.to_tags(), **resolved_tags(spec, hw, runtime, info.img_size, task=spec.task, cuda_graph=spec.cuda_graph), **link_tags(pulled)})
        params = {**spec.to_params(), "gpu": hw.label, "amp": runtime.amp, "device": runtime.device,
                  "img_size": info.img_size, "model_uri": model_uri}
        log_setup(run, params, env, progress)
        progress(f"run {run.run_id} at {tracking.tracking_uri()}; {short} ({info.name}) on gpu={hw.label} "
                 f"({detected.name}), amp={runtime.amp}, compile={spec.compile}")
        run.log_dict(pulled.spec, "model_spec.json")

        result = run_benchmark(spec, hw, runtime, progress, model_factory=lambda: (pulled.model, info))

        metrics = result.metrics()
        run.log_metrics(metrics)
        log_what_ran(run, result)
        run.log_dict(result.to_dict(), "results.json")
        run.log_text(report_markdown(result, env, command), "report.md")
        checkpoints.link_infer_run(pulled, run.run_id, metrics, gpu=hw.label)
        if not run_name:
            run.set_name(name(throughputs={t.task: t.throughput.median for t in result.tasks}))
        run.set_note(naming.run_note(result.to_dict(), ran_on=hw.detected.name if hw.mismatch else None))
    print(results_table(result))
    if pulled.version_uri:
        print(f"tagged {pulled.version_uri} last_infer_run_id={run.run_id}")
    print(tracking.where_logged(run))
    return result


def link_tags(pulled: checkpoints.PullResult) -> dict:
    """Run tags that point at what was benchmarked."""
    tags = {"vitreg_job": "infer", "model_uri": pulled.uri, "source_run_id": pulled.run_id,
            "checkpoint_step": pulled.spec.get("step")}
    if pulled.version_uri:
        tags.update(registered_model_name=pulled.registered_model_name,
                    registered_model_version=pulled.registered_model_version,
                    registered_model_alias=pulled.alias)
    return tags
