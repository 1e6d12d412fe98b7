"""The warm worker's own loop (:mod:`vitreg.fleet.worker` says what a child keeps and loses in it): the heavy
imports once, then each child from stdin run as the ``vitreg`` command it is. In the CLI's layer: a child is a
CLI command."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import sys
import threading
import time
import traceback

from vitreg.environment import environ_restored
from vitreg.fleet.worker import DONE
from vitreg.signals import ALL_STOP_SIGNALS


def serve() -> int:
    """The worker's loop until stdin closes; a child stopped by a signal stops the worker too (its sweep is
    stopping)."""
    from vitreg.cli.main import main
    from vitreg.bench import job  # noqa: F401  torch, timm and the job, before the first child's clock starts
    from vitreg.tracking import runs  # noqa: F401  and MLflow
    from vitreg.tracking.store import prepare_store
    from vitreg.tracking.uris import current_uri

    with contextlib.suppress(Exception):  # the store opened (MLflow keeps it) before the first child asks; a
        prepare_store(current_uri())     # store that fails is said by that child, in its run's terms
    gc.freeze()  # the imports' millions of objects: out of every later collection's walk (0.3 s each)
    stops = {128 + s for s in ALL_STOP_SIGNALS}
    threading.Thread(target=_stop_with_parent, args=(os.getppid(),), daemon=True).start()
    try:
        for line in sys.stdin:
            job_line = json.loads(line)
            status = run_child(main, job_line["args"], job_line["env"])
            sys.stdout.flush()
            sys.stderr.write(f"\n{DONE}{status}\n")  # on a line of its own, whatever the child left unended
            sys.stderr.flush()
            if status in stops:
                return status
    except KeyboardInterrupt as exc:  # a stop signal between two children
        return 128 + getattr(exc, "signum", signal.SIGINT)
    return 0


def _stop_with_parent(parent: int) -> None:
    """SIGTERM to this worker once its sweep is gone, so its child ends KILLED (Linux's parent-death signal
    fires when the starting thread ends, which a worker outlives)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)


def run_child(main, args: list[str], env: dict) -> int:
    """``vitreg ARGS`` with ``env`` set for its length: its exit status, as a process of its own would exit."""
    with environ_restored(*env):
        os.environ.update(env)
        try:
            main(args=args, prog_name="vitreg")  # click's standalone mode: it ends in SystemExit, as a process
            status = 0
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # noqa: BLE001  the child failed; the worker goes on
            traceback.print_exc()
            status = 1
    fresh_state()
    return status


def fresh_state() -> None:
    """What one child leaves that would change the next one's figures: dynamo's compiled graphs (a next
    child of other shapes would run a graph recompiled as dynamic), the CUDA allocator's cached blocks and
    peak counters, the lines of how the last run ended."""
    import torch

    from vitreg import signals

    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    signals.run_ends.clear()


if __name__ == "__main__":
    sys.exit(serve())
