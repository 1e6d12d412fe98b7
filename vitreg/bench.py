"""The ``bench`` job: options -> spec -> hardware -> runtime -> runner -> tracking.

This is the whole data flow of DESIGN.md in one function; the entry point and the ``vitreg bench``
command both call :func:`bench`.
"""

from __future__ import annotations

import shlex
import sys

from vitreg import tracking
from vitreg.env import capture_environment, pip_freeze
from vitreg.hardware import detect_hardware, resolve_hardware
from vitreg.models import check_model_name, create_model
from vitreg.report import report_markdown, results_table
from vitreg.runner import BenchResult, run_benchmark
from vitreg.runtime import resolve_runtime
from vitreg.spec import BenchSpec


def _progress(message: str) -> None:
    print(f"[vitreg] {message}", file=sys.stderr, flush=True)


def resolved_tags(spec: BenchSpec, hw, runtime, img_size: int) -> dict:
    """What actually ran, under the names people group by (see tracking's note on params vs tags)."""
    return {
        "gpu": hw.label,
        "amp": runtime.amp,
        "device": runtime.device,
        "img_size": img_size,
        "model": spec.model,
        "task": spec.task,
        "compile": spec.compile,
        "batch_size": spec.batch_size,
        "nproc": spec.nproc,
        "gpu_mismatch": "true" if hw.mismatch else "false",
        "detected_gpu": hw.detected.profile.label,
        "vitreg_job": "bench",
    }


def bench(options: dict, experiment: str | None = None, run_name: str | None = None,
          progress=_progress, command: str | None = None) -> BenchResult:
    """Run one benchmark and log it as one MLflow run. Raises VitregError on bad input (run ends FAILED)."""
    command = command or " ".join(shlex.quote(a) for a in sys.argv)
    with tracking.tracked_run(run_name=run_name, experiment=experiment) as run:
        spec = BenchSpec.from_options(options)
        check_model_name(spec.model)  # cheap, and before any device work
        detected = detect_hardware(spec.device)
        hw = resolve_hardware(spec.gpu, detected, spec.allow_gpu_mismatch)
        runtime = resolve_runtime(spec.amp, spec.compile, spec.compile_backend, detected)
        model, info = create_model(spec.model, spec.img_size)  # on the CPU: checks img_size before GPU work
        env = capture_environment()
        run.set_name(run_name or f"{spec.model}-{hw.label}-{runtime.amp}-{spec.compile}-bs{spec.batch_size}")
        run.set_tags({**env.to_tags(), **resolved_tags(spec, hw, runtime, info.img_size)})
        params = {**spec.to_params(), "gpu": hw.label, "amp": runtime.amp, "device": runtime.device,
                  "img_size": info.img_size}
        skipped = run.log_params(params)
        if skipped:
            progress("kept the params mlflow run logged as typed (" +
                     ", ".join(f"{k}={v}" for k, v in skipped.items()) + "); the resolved values are tags")
        progress(f"run {run.run_id} at {tracking.tracking_uri()}; gpu={hw.label} ({detected.name}), "
                 f"amp={runtime.amp}, compile={spec.compile}")
        run.log_text(env.to_json(), "environment.json")
        run.log_text(pip_freeze(), "pip_freeze.txt")

        result = run_benchmark(spec, hw, runtime, progress, model_factory=lambda: (model, info))

        run.log_metrics(result.metrics())
        run.log_dict(result.to_dict(), "results.json")
        run.log_text(report_markdown(result, env, command), "report.md")
    print(results_table(result))
    print(f"logged run {run.run_id} to {tracking.tracking_uri()} (open it with `mlflow ui`)")
    return result
