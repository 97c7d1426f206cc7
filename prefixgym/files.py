"""Atomic writes, checksums and leftovers: files that appear whole or not at all.

Each file or directory is written under a temporary name in the same directory
(`.NAME.XXXX.tmp`), flushed to disk, and moved into place with `os.replace`, so a
crash mid-write leaves what was there before. A process killed mid-write leaves its
temporary behind; `remove_temporaries` deletes them (a checkpoint directory's can
be tens of MB). `file_checksum` / `verify_checksums` are how a manifest records the
files it names and how a reader finds one damaged since (a flipped byte, a
truncation). The checksum is CRC-32: it is there to catch accidental damage, which
it always does for one or two flipped bits and misses with odds 2^-32 otherwise; no
checksum kept beside the files could stop a deliberate edit, and CRC-32 runs about
6x faster than SHA-256 here (a tiny-model checkpoint is 63 MB, hashed on every save
and load). Checkpoints (the engine's training state, the trainer's run state) and
the metrics log are written this way. `read_jsonl` reads a file of one JSON value a
line, for inputs a user hands a command (tasks, recorded runs); `is_gguf_path` tells a
GGUF file by its name, and `cache_root` is where per-machine caches go. Knows files only.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

TEMPORARY_SUFFIX = ".tmp"
CHECKSUM_ALGORITHM = "crc32"


def write_file_atomically(path: Path, write: Callable[[str], None]) -> None:
    """Call `write(tmp_path)`, fsync, then move tmp_path onto `path`."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMPORARY_SUFFIX, dir=path.parent)
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
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=TEMPORARY_SUFFIX,
                                dir=target.parent))
    try:
        fill(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def is_temporary(name: str) -> bool:
    """Whether `name` is one of the temporaries the functions above write."""
    return name.startswith(".") and name.endswith(TEMPORARY_SUFFIX)


def remove_temporaries(directory: Path) -> list[str]:
    """Delete the temporaries that killed writes left in `directory` (not below it);
    returns their names. Only for a directory that one process writes at a time."""
    if not directory.is_dir():
        return []
    removed = []
    for entry in directory.iterdir():
        if not is_temporary(entry.name):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry.name)
    return sorted(removed)


def file_checksum(path: Path) -> str:
    """`crc32:<8 hex digits>` of the file's bytes."""
    crc = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            crc = zlib.crc32(block, crc)
    return f"{CHECKSUM_ALGORITHM}:{crc:08x}"


def verify_checksums(directory: Path, checksums: Mapping[str, object], manifest: Path) -> None:
    """Every file named in `checksums` (relative to `directory`) exists and has the
    recorded checksum; ValueError naming the file and `manifest` otherwise."""
    for name, expected in checksums.items():
        path = directory / name
        if not path.is_file():
            raise ValueError(f"{path} is missing (named in {manifest})")
        if not isinstance(expected, str) or ":" not in expected:
            raise ValueError(f"{manifest}: the checksum of {name} is not 'algorithm:hex'")
        if file_checksum(path) != expected:
            raise ValueError(f"{path} is damaged: its checksum differs from the one in "
                             f"{manifest} (a changed or truncated file)")


CACHE_VARIABLE = "PREFIXGYM_CACHE_DIR"


def cache_root() -> Path:
    """Where prefixgym keeps what it computes once per machine (a .gguf file's
    conversion, the packed weights' thread checks): $PREFIXGYM_CACHE_DIR, else
    $XDG_CACHE_HOME/prefixgym, else ~/.cache/prefixgym."""
    if os.environ.get(CACHE_VARIABLE):
        return Path(os.environ[CACHE_VARIABLE])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "prefixgym"


def is_gguf_path(name: str | os.PathLike[str]) -> bool:
    """Whether `name` names a GGUF file (llama.cpp's format), by its suffix: `--model`
    takes one beside presets and checkpoint directories (it may not exist)."""
    return os.fspath(name).lower().endswith(".gguf")


def ensure_writable_dir(path: Path) -> None:
    """Create directory `path` (with its parents) and check that a file can be written
    in it; ValueError naming it otherwise (a file in the way, no permission, ...)."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} is a file, not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-check.", suffix=TEMPORARY_SUFFIX, dir=path)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"{path} is not a writable directory: {e.strerror or e}") from None


def read_jsonl(path: str | Path, flag: str) -> list[tuple[int, Any]]:
    """(line number, value) for each non-blank line of a JSONL file; ValueError in one
    line, starting with `flag` and the path, for a file that cannot be read or a line
    that is not JSON."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror or e}") from None
    values = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            values.append((number, json.loads(line)))
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag} {path}:{number}: not JSON ({e.msg})") from None
    return values
