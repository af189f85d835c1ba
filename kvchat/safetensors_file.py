"""Write safetensors files: whole and atomically (:func:`save_atomic`; directory 0700, file 0600), or tensor by tensor
(:class:`StreamingWriter`)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from kvchat.store.atomic_write import write_atomic

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                     "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                     "BOOL": torch.bool}  # safetensors dtype names (format spec, "dtype" field) -> torch dtypes


def save_atomic(tensors: dict, path: Path, metadata: dict[str, str]) -> Path:
    """Write ``tensors`` (``{name: torch.Tensor}``, contiguous, CPU) with ``metadata`` to ``path``; returns ``path``.

    A reader sees either no file or the whole file (the temp file is renamed
    over ``path`` after an fsync).

    Raises:
        OSError: the directory is not writable (or the disk is full).
    """
    from safetensors.torch import save_file

    return write_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


# safetensors' own order of dtypes (its Rust ``Dtype`` enum), low to high: a file holds its tensors from the
# highest dtype down, then by name (measured on safetensors' save_file; a dtype missing here is refused)
SAFETENSORS_ORDER = ("BOOL", "U8", "I8", "I16", "F16", "BF16", "I32", "F32", "F64", "I64")


class StreamingWriter:
    """A safetensors file written tensor by tensor, in any order, never holding more than the tensor given.

    The header is written first from the names, dtypes and shapes announced (``layout``); each :meth:`write` puts
    one tensor's bytes at its offset. The file is laid out as ``safetensors``' own writer lays it out (tensors
    by dtype, :data:`SAFETENSORS_ORDER` from the top, then by name; offsets back to back; the JSON header
    compact, ``__metadata__`` first, padded with spaces to a multiple of 8 bytes), so it is byte for byte what
    ``save_file`` writes for the same tensors (``tests/bench/test_random_checkpoint.py``), which copies every
    tensor into bytes first.
    """

    def __init__(self, path: Path, layout: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        """Create ``path`` and write its header for the tensors of ``layout`` (``{name: (dtype, shape)}``) and
        ``metadata`` (one key at most: safetensors writes several in a hash map's order).

        Raises:
            ValueError: more than one metadata key, or a dtype outside :data:`SAFETENSORS_ORDER`.
            OSError: the file cannot be written.
        """
        import json

        names = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
        if metadata is not None and len(metadata) > 1:
            raise ValueError("one metadata key at most in a streamed file")
        bad = sorted({str(d) for d, _ in layout.values() if names.get(d) not in SAFETENSORS_ORDER})
        if bad:
            raise ValueError(f"dtypes without a place in safetensors' order here: {', '.join(bad)}")
        header: dict[str, object] = {"__metadata__": metadata} if metadata is not None else {}
        self.offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name in sorted(layout, key=lambda n: (-SAFETENSORS_ORDER.index(names[layout[n][0]]), n)):
            dtype, shape = layout[name]
            n = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": names[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            self.offsets[name] = (offset, offset + n)
            offset += n
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.data_start = 8 + len(blob)
        self.layout = layout
        self.file = open(path, "wb")
        self.file.write(len(blob).to_bytes(8, "little") + blob)
        self.file.truncate(self.data_start + offset)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write tensor ``name`` (CPU, of its announced dtype and shape) at its place.

        Raises:
            KeyError: ``name`` was not announced; ValueError: another dtype or shape.
        """
        dtype, shape = self.layout[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"{name}: {tensor.dtype} {list(tensor.shape)}, announced {dtype} {list(shape)}")
        self.file.seek(self.data_start + self.offsets[name][0])
        self.file.write(memoryview(tensor.contiguous().view(-1).view(torch.uint8).numpy()))

    def close(self) -> None:
        """Close the file."""
        self.file.close()
