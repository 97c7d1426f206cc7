"""Atomic writes: a file or a directory appears whole under its name, or not at all.

Each is written under a temporary name in the same directory, flushed to disk, and
moved into place with `os.replace`, so a crash mid-write leaves what was there
before. Checkpoints (the engine's training state, the trainer's run state) and the
metrics log are written this way. Knows files only.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_file_atomically(path: Path, write: Callable[[str], None]) -> None:
    """Call `write(tmp_path)`, fsync, then move tmp_path onto `path`."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_text_atomically(path: Path, text: str) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(text)

    write_file_atomically(path, write)


def write_dir_atomically(target: Path, fill: Callable[[Path], None]) -> None:
    """Call `fill(tmp_dir)`, then put tmp_dir in place of `target` (replacing it)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        fill(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
