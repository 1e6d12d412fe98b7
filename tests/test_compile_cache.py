"""The persistent compile cache (cold, then warm in a fresh process) and the ticker shown while compiling."""

import json
import os
import subprocess
import sys
import threading

import pytest

from conftest import REPO
from vitreg.errors import VitregError
from vitreg.hardware.compile_cache import CacheProbe, default_cache_dir, use_compile_cache
from vitreg.console import ticking

COMPILE_ONCE = """
import json, sys
from pathlib import Path
from vitreg.hardware.compile_cache import CacheProbe, use_compile_cache
folder = use_compile_cache(sys.argv[1])
before = set(folder.rglob("*"))
import torch
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
compiled, x = torch.compile(model), torch.randn(8, 16)
probe = CacheProbe().start()
compiled(x).sum().backward()  # a training graph: forward and backward through AOTAutograd and inductor
print(json.dumps({"state": probe.state(), "new": sorted(p.name for p in set(folder.rglob("*")) - before)}))
"""


def test_default_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("VITREG_COMPILE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "vitreg" / "inductor"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert str(default_cache_dir()).endswith(".cache/vitreg/inductor")
    monkeypatch.setenv("VITREG_COMPILE_CACHE", str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine"


def test_the_folder_is_made_and_handed_to_inductor(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")
    folder = use_compile_cache(tmp_path / "new" / "cache")
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    assert folder.is_dir() and list(folder.iterdir()) == []  # the write check leaves nothing behind
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder) == cache_dir()


def test_an_unwritable_folder_is_refused_in_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(VitregError) as err:
        use_compile_cache(blocker / "cache")  # a folder under a plain file cannot exist, even for root
    assert "is not writable" in str(err.value) and "set compile_cache=" in str(err.value)
    assert "\n" not in str(err.value)


def test_no_compile_means_the_cache_was_unused():
    assert CacheProbe().start().state() == "unused"


@pytest.mark.slow
def test_a_second_process_finds_the_graphs_warm_and_compiles_nothing(tmp_path):
    """What makes the second process faster, counted rather than timed: it builds no kernel (no new file in the
    cache: the cold one wrote its C++ kernels' shared objects there)."""
    def compile_once():
        done = subprocess.run([sys.executable, "-c", COMPILE_ONCE, str(tmp_path / "cache")], capture_output=True,
                              text=True, timeout=600, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])

    cold, warm = compile_once(), compile_once()
    assert (cold["state"], warm["state"]) == ("cold", "warm")
    assert any(name.endswith(".so") for name in cold["new"]) and warm["new"] == [], (cold, warm)


class Said(list):
    """A ``say`` callback that keeps the lines and lets a test wait until ``n`` have come (no fixed sleeps)."""

    def __init__(self):
        super().__init__()
        self.grown = threading.Condition()

    def __call__(self, line: str) -> None:
        with self.grown:
            self.append(line)
            self.grown.notify_all()

    def wait_for(self, n: int, timeout_s: float = 30) -> bool:
        with self.grown:
            return self.grown.wait_for(lambda: len(self) >= n, timeout_s)


def ticker_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "vitreg-ticker"]


def test_the_ticker_reports_while_the_block_runs_and_stops_after():
    said = Said()
    with ticking("compiling (max-autotune)", every_s=0.05, say=said):
        assert said.wait_for(3), said  # it reports while the block runs
    count = len(said)
    # the block's end joined the ticker: nothing more can be said, so the timed windows that follow stay quiet
    assert not ticker_threads() and len(said) == count >= 3
    assert said[0].startswith("compiling (max-autotune) ... ") and said[0].endswith(" s")


def test_a_quick_block_says_nothing_and_an_error_still_stops_the_ticker():
    said = Said()
    with ticking("compiling (default)", every_s=5, say=said):
        pass
    assert said == [] and not ticker_threads()  # quicker than every_s: nothing said
    with pytest.raises(KeyError), ticking("compiling (default)", every_s=0.01, say=said):
        assert said.wait_for(1), said
        raise KeyError("boom")
    count = len(said)
    assert not ticker_threads() and len(said) == count  # the error ended the block and the ticker with it
