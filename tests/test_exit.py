"""vitreg's exit handler (vitreg.signals.freeze_at_exit): in CLI processes and torchrun workers the shutdown collections
are skipped, and no other exit handler is; importing vitreg as a library changes nothing at exit."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PROBE = "import atexit, gc\ndef probe(when):\n    atexit.register(lambda: print(when, 'frozen', gc.get_freeze_count() > 0))\n"


def run_python(code: str, *args: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", PROBE + textwrap.dedent(code), *args], capture_output=True,
                          text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


@pytest.mark.slow
def test_cli_freezes_objects_only_after_every_exit_handler_its_command_registered_has_run():
    lines = run_python("""
        probe("registered before the CLI:")
        from vitreg.cli.main import main

        @main.command("probe")
        def probe_command():
            probe("registered by the command:")  # as mlflow's, torch's handlers are, on import
            print("working")

        main(["probe"])
    """)
    # atexit runs last-registered first: the handlers the command's imports register run before the
    # freeze (registered when the CLI started); only one registered before the CLI started sees it
    assert lines == ["working", "registered by the command: frozen False", "registered before the CLI: frozen True"]


@pytest.mark.slow
def test_torchrun_worker_shim_freezes_after_the_worker_s_own_handlers(tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(PROBE + 'probe("registered by the worker:")\nprint("working")\n')
    lines = run_python("""
        import runpy, sys
        probe("registered before the shim:")
        sys.argv = ["vitreg.ddp.launcher", "--", sys.argv[1]]
        runpy.run_module("vitreg.ddp.launcher", run_name="__main__", alter_sys=True)
    """, str(worker))
    assert lines == ["working", "registered by the worker: frozen False", "registered before the shim: frozen True"]


@pytest.mark.slow
def test_importing_vitreg_registers_nothing():
    lines = run_python("""
        probe("registered before the imports:")  # would run after a freeze the imports registered
        import vitreg, vitreg.cli.main, vitreg.config.spec, vitreg.ddp.launcher
    """)
    assert lines == ["registered before the imports: frozen False"]
