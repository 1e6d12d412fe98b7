"""Files vitreg writes for the user get the user's permissions (their umask), whatever mode the file
they were made from had.

``safetensors`` writes ``model.safetensors`` as 0600 (it writes a temporary file and renames it),
MLflow's local artifact store and its downloads keep that mode, and ``shutil.copy2`` copies it: so
the weights in a ``vitreg pull --out`` folder were readable by their owner only, next to 0644
``spec.json`` and ``README.md``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def copy_as_new_file(src, dst) -> Path:
    """Copy ``src``'s bytes (not its mode) to ``dst``, a new file created with the umask's mode."""
    dst = Path(dst)
    dst.unlink(missing_ok=True)  # an existing file would keep its own mode; a new one gets 0666 & ~umask
    shutil.copyfile(src, dst)
    return dst


def follow_umask(path) -> Path:
    """Give a file that a library created with its own mode (safetensors' 0600) the umask's mode."""
    path = Path(path)
    os.chmod(path, 0o666 & ~current_umask())
    return path


def current_umask() -> int:
    """The process's umask. Linux shows it in /proc/self/status; elsewhere it is read by setting it
    and setting it back (a moment in which another thread's new files would get 0o022)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
