"""One warm interpreter for the slow tests that run many ``vitreg`` commands whose point is what each command
does and prints, not how its process starts: vitreg's own warm worker (:mod:`vitreg.cli.worker`, what a sweep
runs its children in) started once, a real process of its own, each command run in it as ``vitreg ARGS``.

A command in a process of its own pays the interpreter and the torch/timm/MLflow imports, 4-6 s of CPU on
this project's 2-core machines; here the worker pays them once. What a test still sees is a process's: the
exit status the command would have exited with, every byte it wrote on stdout and stderr (fds 1 and 2, C
libraries' writes included; what the worker prints as it starts counts as the first command's), and what
the worker prints as it ends (atexit handlers: :meth:`close`). The tests
about the process itself (its start, its imports, its signals) start their own.
"""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path

from vitreg.fleet.worker import DONE, python_command


class WarmVitreg:
    """``vitreg`` commands, one after another, in one worker started in ``cwd`` with ``env`` (and ``popen``'s
    other arguments: a ``preexec_fn``); its stdout goes to ``out_file`` (a file, not a pipe: once the worker says
    a command ended, all it wrote is there)."""

    def __init__(self, cwd: Path, env: dict, out_file: Path, **popen):
        self._out_path = Path(out_file)
        self._out = open(self._out_path, "wb")
        self._read = 0
        self.proc = subprocess.Popen(python_command("vitreg.cli.worker"), cwd=cwd, env=env, stdin=subprocess.PIPE,
                                     stdout=self._out, stderr=subprocess.PIPE, text=True, bufsize=1, **popen)

    def _new_stdout(self) -> str:
        with open(self._out_path, "rb") as out:
            out.seek(self._read)
            data = out.read()
        self._read += len(data)
        return data.decode(errors="replace")

    def run(self, *args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
        """``vitreg ARGS`` with ``env`` added for its length: what a process of its own would have returned. A
        command still running after ``timeout`` seconds is killed with the worker (as subprocess.run's timeout
        kills a process of its own) and fails the test."""
        self.proc.stdin.write(json.dumps({"args": list(args), "env": env or {}}) + "\n")
        self.proc.stdin.flush()
        err = []
        watchdog = threading.Timer(timeout, self.proc.kill)
        watchdog.start()
        try:
            for line in self.proc.stderr:
                if line.startswith(DONE):
                    if err and err[-1] == "\n":  # the worker's own newline before its DONE line
                        err.pop()
                    return subprocess.CompletedProcess(["vitreg", *args], int(line[len(DONE):]), self._new_stdout(),
                                                       "".join(err))
                err.append(line)
        finally:
            watchdog.cancel()
        code = self.proc.wait()
        raise AssertionError(f"the warm worker died (exit {code}; killed after {timeout:g} s if -9) running vitreg "
                             f"{' '.join(args)}:\n{self._new_stdout()}\n{''.join(err)[-3000:]}")

    def close(self, timeout: float = 120) -> subprocess.CompletedProcess:
        """End the worker (stdin closed): what it printed as it ended, its exit status."""
        self.proc.stdin.close()
        try:
            err = self.proc.stderr.read()
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            err, code = "", self.proc.wait()
        finally:
            self.proc.stderr.close()
            self._out.close()
        return subprocess.CompletedProcess(["vitreg-worker"], code, self._new_stdout(), err)
