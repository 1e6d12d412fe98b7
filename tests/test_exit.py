"""vitreg's exit handler (vitreg/__init__.py): the shutdown collections are skipped, no other exit handler is."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_objects_are_frozen_only_after_every_exit_handler_registered_later_has_run():
    code = textwrap.dedent("""
        import atexit, gc
        atexit.register(lambda: print("registered before vitreg: frozen", gc.get_freeze_count() > 0))
        import vitreg
        atexit.register(lambda: print("registered after vitreg: frozen", gc.get_freeze_count() > 0))
        print("working")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    # atexit runs last-registered first: the handlers that mlflow and others register on import run
    # before vitreg's freeze; only one registered before vitreg was imported sees it
    assert proc.stdout.splitlines() == ["working", "registered after vitreg: frozen False",
                                        "registered before vitreg: frozen True"]
