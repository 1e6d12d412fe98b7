"""The ``infer`` job: benchmark a registered model's real weights, logged exactly like ``bench``.

options -> spec (the model and img_size come from the registered checkpoint) -> job context
(hardware, runtime) -> pull (verified, rebuilt timm model) -> bench's own body
(:func:`vitreg.bench.job.benchmark_in_run`: runner -> tracking); then the run and the model
version are linked both ways: the run gets ``model_uri``, ``registered_model_name`` and
``registered_model_version`` tags, the version gets ``last_infer_run_id`` and the throughput.
"""

from __future__ import annotations

import shlex
import sys
import tempfile

from vitreg.bench.job import Logged, benchmark_in_run
from vitreg.bench.report import results_table
from vitreg.bench.results import BenchResult
from vitreg.config.spec import BenchSpec, parse_int
from vitreg.console import progress
from vitreg.ddp.context import job_context
from vitreg.errors import VitregError
from vitreg.tracking import checkpoint_sources, naming
from vitreg.tracking import runs as tracking

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
        ctx = job_context(run, BenchSpec.from_options({**options, "model": "pending"}), progress)
        with tempfile.TemporaryDirectory(prefix="vitreg-infer-") as tmp:
            pulled = checkpoint_sources.pull(model_uri, dst=tmp, progress=progress)
        info = pulled.info
        ctx = ctx.with_spec(BenchSpec.from_options({**options, "model": info.name, "img_size": info.img_size}))
        run.log_dict(pulled.spec, "model_spec.json")
        result = benchmark_in_run(ctx, info, lambda: (pulled.model, info), _logged(ctx, pulled, model_uri, command,
                                                                                  run_name))
    print(results_table(result))
    if pulled.version_uri:
        print(f"tagged {pulled.version_uri} last_infer_run_id={run.run_id}")
    print(tracking.where_logged(run))
    return result


def _logged(ctx, pulled: checkpoint_sources.PullResult, model_uri: str, command: str, run_name) -> Logged:
    """What infer logs of its own around bench's body: the registered model in the name, the links both
    ways (run tags; the version's ``last_infer_run_id`` and throughput), ``model_uri`` as a param."""
    spec, info = ctx.spec, pulled.info
    what = (f"{pulled.registered_model_name}-v{pulled.registered_model_version}" if pulled.version_uri
            else f"{info.name}-run-{(pulled.run_id or 'local')[:8]}")
    hw = ctx.hardware
    name = naming.RunTitle(hw.label, what, ctx.runtime.amp, spec.compile, cuda_graph=spec.cuda_graph, job="infer",
                           ran_on=hw.detected.profile.label if hw.mismatch else None).name

    def after(result, tags):
        checkpoint_sources.link_infer_run(pulled, ctx.run.run_id, result.metrics(), gpu=ctx.hardware.label)

    return Logged(run_name, command, name, lambda env: link_tags(pulled), {"model_uri": model_uri},
                  f"{pulled.version_uri or model_uri} ({info.name}) on ", after)


def link_tags(pulled: checkpoint_sources.PullResult) -> dict:
    """Run tags that point at what was benchmarked."""
    tags = {"vitreg_job": "infer", "model_uri": pulled.uri, "source_run_id": pulled.run_id,
            "checkpoint_step": pulled.spec.get("step")}
    if pulled.version_uri:
        tags.update(registered_model_name=pulled.registered_model_name,
                    registered_model_version=pulled.registered_model_version,
                    registered_model_alias=pulled.alias)
    return tags
