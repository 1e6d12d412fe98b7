"""A sweep's warm worker: one process per GPU of this host (per CPU on a host without one) that runs the
children given that GPU one after another, in-process, each as the ``vitreg bench`` command it would be alone.

Why: a child in a fresh process paid its interpreter, the imports, the store's set-up, the CUDA context and a
cold compile before its first timed step (10-16 s a child on an H200);
the worker pays them once per GPU.

What a child keeps, against a process of its own (``--isolate process``): its own MLflow run (handed to it as
``mlflow run`` does, ``MLFLOW_RUN_ID``), its seed, a graph of its own (dynamo's caches are reset between
children; inductor's compiled code is kept), an emptied CUDA caching allocator and fresh peak-memory counters,
and its own failure (that child ends FAILED, the worker takes the next). What it loses: the CUDA context and the
cuBLAS/cuDNN handles are shared (a fault that poisons the context ends the worker: the parent ends its child
FAILED and starts a new worker), and process-wide state no child resets lives on.

The protocol: the parent (:class:`vitreg.fleet.local.Worker`) writes one JSON line per child to the worker's
stdin (its arguments and its run's variables); the worker (:func:`vitreg.cli.worker.serve`) runs it and writes
:data:`DONE` and the exit status on stderr. stdout is the children's; a closed stdin ends the worker.
"""

from __future__ import annotations

import sys

#: Starts the line that ends a child on the worker's stderr; the exit status follows it.
DONE = "\x1evitreg-worker-done "


def python_command(module: str, *args: str) -> list[str]:
    """``python -m MODULE ARGS`` without the working directory on the import path: ``-m`` (and ``-c``) put it
    first, so from the folder that holds a clone ``vitreg`` was the clone's folder and ``vitreg.tracking`` its
    top-level ``tracking/`` (every child failed). ``-P`` does this from Python 3.11 only."""
    code = f"import runpy, sys; del sys.path[0]; runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"
    return [sys.executable, "-c", code, *args]


def cli_args(command: list[str]) -> list[str]:
    """What a worker runs of ``python_command("vitreg.cli", *args)``: the ``args``. Another command (a test's
    stand-in child script) runs in a process of its own: ``isolate=process``."""
    head = python_command("vitreg.cli")
    if command[:len(head)] != head:
        raise ValueError(f"a warm worker runs vitreg's own commands, not {command[:2]}: pass isolate=process")
    return command[len(head):]
