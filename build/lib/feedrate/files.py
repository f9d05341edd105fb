"""Writes that never leave a half-written file: a temporary file in the same directory,
flushed and fsynced, then renamed over the target (atomic on POSIX filesystems)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], Any]) -> Path:
    """Call ``write(fh)`` on a temporary file beside ``path``, then rename it to ``path``.

    If anything fails (an exception, a full disk, the process killed), ``path`` keeps its old
    content and the temporary file is removed (or, if the process was killed, left as
    ``.<name>.*.tmp`` beside it, never in its place).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, _mode(path))  # mkstemp makes 0600; a written file reads like any other
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def _mode(path: Path) -> int:
    """The mode ``path`` has, or the one a new file gets under this process's umask."""
    try:
        return path.stat().st_mode & 0o777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write(path, lambda fh: fh.write(text.encode()))


def save_checkpoint(path: str | os.PathLike, state: dict) -> Path:
    return atomic_write(path, lambda fh: torch.save(state, fh))
