"""Write a safetensors file atomically (:func:`kvchat.store.atomic_write.write_atomic`); directory 0700, file 0600."""

from __future__ import annotations

from pathlib import Path

from kvchat.store.atomic_write import write_atomic


def save_atomic(tensors: dict, path: Path, metadata: dict[str, str]) -> Path:
    """Write ``tensors`` (``{name: torch.Tensor}``, contiguous, CPU) with ``metadata`` to ``path``; returns ``path``.

    A reader sees either no file or the whole file (the temp file is renamed
    over ``path`` after an fsync).

    Raises:
        OSError: the directory is not writable (or the disk is full).
    """
    from safetensors.torch import save_file

    return write_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
