"""Files replaced so that a reader, or a crash, sees the old file or the whole new one, never a part.

The new content goes to a temp file beside the target, is fsynced, renamed over the target, and the
directory is fsynced so the rename itself survives a crash.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable


def fsync_dir(path: Path) -> None:
    """fsync the directory ``path``, so an entry created or renamed in it survives a crash.

    Raises:
        OSError: ``path`` is not a directory that can be opened.
    """
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, write: Callable[[Path], None], mode: int | None = 0o600) -> Path:
    """Replace ``path`` with what ``write(temp path)`` writes there; returns ``path``.

    The parent directory is created (0700) if missing; ``mode``: the file's permission bits (None: as
    created, under the umask). The temp file is removed whatever happens.

    Raises:
        OSError: the directory is not writable, or the disk is full (``path`` is then as it was).
    """
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        if mode is not None:
            os.chmod(tmp, mode)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return path
