"""Stream a checkpoint's tensors into already-allocated parameters, one tensor at a time.

The model is built on the ``meta`` device and given uninitialised storage in
its compute dtype on its own device (:func:`kvchat.model.transformer.build_model`);
each parameter is then filled from the safetensors files here. Nothing holds a
second copy of the weights:

- on CPU, when the stored dtype is the compute dtype, a tensor's bytes are
  read (``readinto``) straight into the parameter's memory (a fused q/k/v or
  gate/up parameter gets each part read into its row slice);
- otherwise a tensor is read into a host staging buffer of its stored dtype
  in pieces of whole rows of at most :data:`STAGING_BYTES` (for CUDA one pinned
  buffer, reused, as large as the largest piece: an 8B checkpoint's 1 GiB
  embedding does not pin 1-2 GiB of host memory), each converted on the host
  when the dtypes differ and copied to its rows of the parameter: one piece in
  flight, on the host. :meth:`CheckpointReader.close` (the engine calls it once
  the weights are in) frees the buffer and gives the pinned pages back.

Device memory while loading (CUDA, reasoned; measured by ``bench/gpu.py`` (d)):
``to_empty`` allocates every parameter once in the compute dtype, which is
the bf16 weight bytes for a bf16 load; each copy lands in its parameter (a
fused q/k/v or gate/up in its row slice), so nothing else is allocated on the
device until the pool: peak = weight bytes (+ RoPE's few KB), within the
issue's bf16 bytes + 10%. (Before: fp32 build then cast, ~2x the bf16 bytes
plus a second engine for calibration.)

Why plain reads, not ``safe_open``'s memory map: every page of a mapped file
that a read touches counts in the process's resident set until the map is
closed, so mapping the checkpoint and copying out of it peaks at twice its
size on CPU. File offsets come from the header parser that the fingerprint
uses (:func:`kvchat.model.fingerprint.tensor_entries`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Mapping

import torch

from kvchat.device import release_pinned_cache
from kvchat.model.fingerprint import TensorEntry, WeightFileError, read_tensor_entries, tensor_entries
from kvchat.safetensors_file import SAFETENSORS_DTYPES

STAGING_BYTES = 256 * 2**20  # a staging piece at most (a whole row more if one row is larger)



class CheckpointReader:
    """Tensors of a checkpoint directory, read on demand by name (see module doc).

    Attributes:
        entries: name -> :class:`TensorEntry` (file, stored dtype, shape, byte range).
    """

    def __init__(self, model_dir: Path):
        """Parse every safetensors header of ``model_dir`` (no tensor data is read); ``model_dir`` may also be one
        safetensors file (a model's stored quantized weights, :mod:`kvchat.model.quantized_load`).

        Raises:
            WeightFileError: no weights, a malformed file, a dtype this reader does not know, or offsets that do not
                span exactly a tensor's bytes.
        """
        model_dir = Path(model_dir)
        found = tensor_entries(model_dir) if model_dir.is_dir() else read_tensor_entries(model_dir)
        self.entries = {e.name: e for e in found}
        for e in self.entries.values():
            if e.dtype not in SAFETENSORS_DTYPES:
                raise WeightFileError(f"{e.file}: tensor {e.name!r} has dtype {e.dtype}, which kvchat cannot load")
            if e.end - e.begin != math.prod(e.shape) * SAFETENSORS_DTYPES[e.dtype].itemsize:
                raise WeightFileError(f"{e.file}: tensor {e.name!r} spans {e.end - e.begin} bytes, not its shape's "
                                      f"{math.prod(e.shape)} x {e.dtype}")
        self._files: dict[Path, object] = {}
        self._pinned: torch.Tensor | None = None
        self.on_read: Callable[[int], None] | None = None  # called with each tensor's bytes once it is read

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def shape(self, name: str) -> tuple[int, ...]:
        """Stored shape of ``name``. Raises KeyError if absent."""
        return self.entries[name].shape

    def num_params(self) -> int:
        """Elements over all tensors (as stored: a tied head that is not stored is not counted)."""
        return sum(math.prod(e.shape) for e in self.entries.values())

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Fill ``out`` (any device and floating dtype, the tensor's shape) with tensor ``name``.

        Raises:
            KeyError: no tensor ``name``.
            ValueError: ``out`` has another number of elements.
            WeightFileError: the file ends inside the tensor.
        """
        e = self.entries[name]
        stored = SAFETENSORS_DTYPES[e.dtype]
        if out.numel() != math.prod(e.shape):
            raise ValueError(f"{name}: stored shape {list(e.shape)} does not fit a parameter of shape {list(out.shape)}")
        self._fill(e, stored, out)
        if self.on_read is not None:
            self.on_read(e.end - e.begin)

    def skip(self, name: str) -> None:
        """Count tensor ``name`` as read without reading it (its bytes go to :attr:`on_read`): a layer whose
        quantized form comes from another file, so that the load's progress still ends at its total."""
        if self.on_read is not None:
            self.on_read(self.entries[name].end - self.entries[name].begin)

    def _fill(self, e: TensorEntry, stored: torch.dtype, out: torch.Tensor) -> None:
        """:meth:`read_into`'s copy: straight into ``out`` where it is a contiguous CPU tensor of the stored
        dtype, else through the staging buffer in pieces (see the module doc)."""
        if out.device.type == "cpu" and out.dtype == stored and out.is_contiguous():
            self._read(e, out)
            return
        pinned = out.device.type == "cuda"
        rows = out.shape[0] if out.dim() else 1
        row_bytes = (e.end - e.begin) // max(rows, 1)
        dest = out if out.dim() else out.view(1)
        for a, b in staging_pieces(rows, row_bytes, STAGING_BYTES):
            staging = self._staging(b - a, row_bytes, stored, pinned)
            self._read(e, staging, offset=a * row_bytes)
            if stored != out.dtype:
                staging = staging.to(out.dtype)  # on the host: the device never holds the stored dtype's copy
            dest[a:b].copy_(staging.view(dest[a:b].shape), non_blocking=False)

    def _staging(self, rows: int, row_bytes: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        """A flat host tensor of ``rows`` rows of ``row_bytes`` in the stored ``dtype`` over one reused buffer
        (pinned for CUDA copies, which are synchronous here, so the next piece may overwrite it), grown to
        the largest piece (:func:`staging_pieces`)."""
        nbytes = rows * row_bytes
        buf = self._pinned if pinned else None
        if buf is None or buf.numel() < nbytes:
            if pinned:
                self._pinned = buf = None  # the smaller buffer goes before the larger one is pinned
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pinned)
            if pinned:
                self._pinned = buf
        return buf[:nbytes].view(dtype)

    def _read(self, e: TensorEntry, out: torch.Tensor, offset: int = 0) -> None:
        """Read ``out``'s size in bytes of ``e``'s data, from ``offset`` bytes into it, into contiguous CPU
        ``out`` of the stored dtype."""
        f = self._files.get(e.file)
        if f is None:
            f = self._files[e.file] = open(e.file, "rb", buffering=0)
        view = memoryview(out.view(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
        f.seek(e.begin + offset)
        done = 0
        while done < len(view):
            n = f.readinto(view[done:])
            if not n:
                raise WeightFileError(f"{e.file}: truncated inside tensor {e.name!r}")
            done += n

    def close(self) -> None:
        """Close the open files and free the staging buffer, its pinned pages given back to the OS
        (reading again reopens and reallocates them)."""
        for f in self._files.values():
            f.close()
        self._files.clear()
        if self._pinned is not None:
            self._pinned = None
            release_pinned_cache()


def staging_pieces(rows: int, row_bytes: int, limit: int) -> list[tuple[int, int]]:
    """Row ranges ``[a, b)`` covering ``rows`` rows of ``row_bytes`` each, each at most ``limit`` bytes (one
    row where a single row is larger): the pieces a tensor is staged in (:meth:`CheckpointReader.read_into`)."""
    per = max(1, limit // max(row_bytes, 1))
    return [(a, min(a + per, rows)) for a in range(0, rows, per)]


class DictReader:
    """The :class:`CheckpointReader` interface over an in-memory ``{name: tensor}`` (tests, benchmarks)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.tensors = tensors

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of ``name``. Raises KeyError if absent."""
        return tuple(self.tensors[name].shape)

    def num_params(self) -> int:
        """Elements over all tensors."""
        return sum(t.numel() for t in self.tensors.values())

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Copy tensor ``name`` into ``out`` (casting to its dtype). Raises KeyError if absent."""
        out.copy_(self.tensors[name].view(out.shape))

    def skip(self, name: str) -> None:
        """Nothing to count (:meth:`CheckpointReader.skip`)."""

    def close(self) -> None:
        """Nothing to close."""


def weight_reader(weights) -> CheckpointReader | DictReader:
    """``weights`` as a reader: a reader is returned as is, a mapping is wrapped in :class:`DictReader`."""
    return weights if hasattr(weights, "read_into") else DictReader(weights)
