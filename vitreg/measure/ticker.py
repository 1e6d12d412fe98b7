"""A heartbeat while a long call runs: ``compiling (max-autotune) ... 12 s`` every few seconds.

The first call of a compiled model can take minutes (inductor's ``max-autotune`` benchmarks many
kernels per matmul) and prints nothing meanwhile; a user cannot tell that from a hang. :func:`ticking`
prints the elapsed time from a daemon thread until the block ends, then stops the thread before
returning, so nothing is printed into the timed windows that follow. The thread only sleeps and
prints: it takes no lock the compiler or the GPU needs.
"""

from __future__ import annotations

import contextlib
import threading
import time

from vitreg.console import progress


@contextlib.contextmanager
def ticking(what: str, every_s: float = 10.0, say=progress):
    """Say ``{what} ... N s`` every ``every_s`` seconds while the block runs (nothing if it is quicker)."""
    done = threading.Event()
    start = time.perf_counter()

    def tick():
        while not done.wait(every_s):
            say(f"{what} ... {time.perf_counter() - start:.0f} s")

    thread = threading.Thread(target=tick, name="vitreg-ticker", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
