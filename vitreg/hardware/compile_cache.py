"""A persistent torch.compile cache: inductor's FX-graph and AOTAutograd caches in a folder that outlives the run.

Inductor's default, ``/tmp/torchinductor_<user>``, goes with a reboot or a fresh container, and every run then
pays the full compile again (minutes under ``max-autotune``). Whether the cache served a compile is read from
inductor's own counters (:class:`CacheProbe`), not guessed from the folder.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from vitreg.errors import VitregError
from vitreg.environment import environ_restored, user_cache_dir

ENV_VAR = "VITREG_COMPILE_CACHE"
# (counter group, hit name, miss name): inductor's FX-graph cache, and AOTAutograd's, which serves
# the forward+backward pair of a training graph before inductor is asked.
CACHE_COUNTERS = (("inductor", "fxgraph_cache_hit", "fxgraph_cache_miss"),
                  ("aot_autograd", "autograd_cache_hit", "autograd_cache_miss"))


def default_cache_dir() -> Path:
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR]).expanduser()
    return user_cache_dir() / "inductor"


def use_compile_cache(folder: str | os.PathLike | None = None) -> Path:
    """Make inductor cache into ``folder``, else ``$VITREG_COMPILE_CACHE``, else the user's cache folder, with the
    caches on (a user's environment may have turned them off); returns the folder."""
    path = Path(folder).expanduser() if folder else default_cache_dir()
    _require_writable(path)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    inductor_config.autotune_local_cache = True
    functorch_config.enable_autograd_cache = True
    return path


@contextlib.contextmanager
def compile_cache_folder(folder: str | os.PathLike | None = None):
    """:func:`use_compile_cache` for a ``with`` block; the process's own settings come back after."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    with environ_restored("TORCHINDUCTOR_CACHE_DIR"), functorch_config.patch(enable_autograd_cache=True), \
            inductor_config.patch(fx_graph_cache=True, autotune_local_cache=True):
        yield use_compile_cache(folder)


def _require_writable(path: Path) -> None:
    probe = path / f".vitreg-write-check-{uuid.uuid4().hex}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise VitregError(f"compile cache folder {str(path)!r} is not writable ({exc.strerror or exc}): "
                          f"set compile_cache= (or ${ENV_VAR}) to a folder you can write") from None


def _counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {name: int(counters[group][name]) for group, *names in CACHE_COUNTERS for name in names}


@dataclass
class CacheProbe:
    """Cache hits and misses between :meth:`start` and :meth:`state`: ``warm`` (all hits), ``cold``, ``partial``
    or ``unused``."""

    before: dict | None = None

    def start(self) -> CacheProbe:
        self.before = _counts()
        return self

    def hits_and_misses(self) -> tuple[int, int]:
        now = _counts()
        delta = {k: now[k] - self.before.get(k, 0) for k in now}
        # AOTAutograd answers first for a graph it has; where it misses, inductor's FX cache may still hit.
        hits = delta["fxgraph_cache_hit"] + delta["autograd_cache_hit"]
        misses = delta["fxgraph_cache_miss"]
        return hits, misses

    def state(self) -> str:
        hits, misses = self.hits_and_misses()
        if hits and not misses:
            return "warm"
        if misses and not hits:
            return "cold"
        return "partial" if hits else "unused"
