"""Write a safetensors file atomically: temp file, fsync, rename; directory 0700, file 0600."""

from __future__ import annotations

import os
from pathlib import Path


def save_atomic(tensors: dict, path: Path, metadata: dict[str, str]) -> Path:
    """Write ``tensors`` (``{name: torch.Tensor}``, contiguous, CPU) with ``metadata`` to ``path``; returns ``path``.

    A reader sees either no file or the whole file (the temp file is renamed
    over ``path`` after an fsync).

    Raises:
        OSError: the directory is not writable (or the disk is full).
    """
    from safetensors.torch import save_file

    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        os.chmod(tmp, 0o600)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
