"""The paged KV pool: one K and one V tensor for all layers, plus FP8 scales.

Layout per layer (vLLM, Kwon et al. 2023): ``[num_blocks, block_size,
num_kv_heads, head_dim]``; all layers live in one tensor
``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]`` so a block
can be copied, saved or restored for every layer in one indexing op.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvchat.engine.cache_identity import BLOCK_SIZE, KV_DTYPE_NAMES
from kvchat.kernels.layout import KVLayer
from kvchat.kernels.reference import FP8_DTYPE

KV_DTYPES: dict[str, torch.dtype] = dict(zip(KV_DTYPE_NAMES, (FP8_DTYPE, torch.bfloat16, torch.float16)))


class KVDtypeError(ValueError):
    """An unknown KV dtype name was given."""


def kv_torch_dtype(name: str) -> torch.dtype:
    """Map ``fp8|bf16|fp16`` to a torch dtype. Raises :class:`KVDtypeError`."""
    try:
        return KV_DTYPES[name]
    except KeyError:
        raise KVDtypeError(f"unknown KV dtype {name!r} (choose fp8, bf16 or fp16)") from None


@dataclass(slots=True, frozen=True)
class KVCacheSpec:
    """Shape and dtype of a pool, independent of its size."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str = "fp8"
    block_size: int = BLOCK_SIZE

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token occupies in the pool, K + V + scales, all layers."""
        elem = kv_torch_dtype(self.kv_dtype).itemsize
        per_head = self.head_dim * elem + (4 if self.kv_dtype == "fp8" else 0)
        return 2 * self.num_layers * self.num_kv_heads * per_head

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers (K + V + scales)."""
        return self.bytes_per_token * self.block_size


class KVPool:
    """The allocated pool tensors. The only owner of K/V memory.

    Attributes:
        k, v: ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``
            in the spec's dtype.
        k_scale, v_scale: ``[num_layers, num_blocks, block_size, num_kv_heads]``
            float32 for fp8 pools, else ``None``.
        block_writes: per block, how many times anything was written into it;
            every writer calls :meth:`mark_written`, so a reader holding a copy
            (``kvchat.engine.dense_kv``) can tell whether a block changed since it read it.
    """

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device | str = "cpu"):
        if num_blocks < 1:
            raise ValueError("a KV pool needs at least one block")
        self.spec = spec
        self.num_blocks = num_blocks
        shape = (spec.num_layers, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        dtype = kv_torch_dtype(spec.kv_dtype)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.k_scale = self.v_scale = None
        if spec.kv_dtype == "fp8":
            self.k_scale = torch.zeros(shape[:-1], dtype=torch.float32, device=device)
            self.v_scale = torch.zeros(shape[:-1], dtype=torch.float32, device=device)
        self.block_writes = [0] * num_blocks
        fp8 = self.k_scale is not None
        self._layers = [  # views made once: a decode step asks for them 60 times
            KVLayer(self.k[i], self.v[i], self.k_scale[i] if fp8 else None, self.v_scale[i] if fp8 else None)
            for i in range(spec.num_layers)
        ]

    @classmethod
    def from_budget(cls, spec: KVCacheSpec, budget_bytes: int, device: torch.device | str = "cpu") -> "KVPool":
        """Allocate as many blocks as fit in ``budget_bytes`` (bytes, K + V + scales)."""
        return cls(spec, max(1, budget_bytes // spec.bytes_per_block), device)

    @property
    def capacity_tokens(self) -> int:
        """Tokens the pool can hold in total."""
        return self.num_blocks * self.spec.block_size

    @property
    def nbytes(self) -> int:
        """Bytes actually allocated by the pool tensors."""
        tensors = [self.k, self.v, self.k_scale, self.v_scale]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def layer(self, i: int) -> KVLayer:
        """Views of layer ``i``'s pools in kernel layout."""
        return self._layers[i]

    def mark_written(self, block_ids) -> None:
        """Record a write into each of ``block_ids`` (call before or with the write)."""
        for b in set(block_ids):
            self.block_writes[b] += 1

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks ``src -> dst`` in every layer (copy-on-write)."""
        if not pairs:
            return
        self.mark_written(p[1] for p in pairs)
        src = torch.tensor([p[0] for p in pairs], device=self.k.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.k.device)
        for t in (self.k, self.v, self.k_scale, self.v_scale):
            if t is None:
                continue
            view = t.view(torch.uint8) if t.dtype == FP8_DTYPE else t
            view[:, dst] = view[:, src]
