"""The paged KV layout every kernel reads and writes: one layer's pools (:class:`KVLayer`) and a sink.

vLLM's layout (Kwon et al., "Efficient Memory Management for Large Language
Model Serving with PagedAttention", SOSP 2023):

- pools ``k_cache``/``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]``
  in float8_e4m3fn, bfloat16 or float16;
- scales ``k_scale``/``v_scale``: ``[num_blocks, block_size, num_kv_heads]``
  float32 for fp8 pools (one per token and KV head), ``None`` otherwise;
- ``slot_mapping``: int64 ``[num_tokens]``, slot = block * block_size + offset,
  -1 = skip (padding);
- ``block_table``: int32 ``[num_seqs, max_blocks]``; ``seq_lens``: int32
  ``[num_seqs]``, tokens of each sequence in the pool, new ones included;
- a sink (:data:`Sink`): the exact float32 K/V of position 0, ``([num_seqs,
  num_kv_heads, head_dim], same)``, read instead of the stored (quantized)
  position 0 (the attention sink, Xiao et al. 2023; see ``kvchat.engine.runner``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Sink = tuple[torch.Tensor, torch.Tensor]
"""Position 0's exact float32 K and V per sequence (see the module doc)."""


@dataclass(frozen=True, slots=True, eq=False)  # tensors: compared by identity, never elementwise
class KVLayer:
    """One layer's paged pools: what a cache write fills and attention reads (shapes in the module doc).

    Attributes:
        k_cache, v_cache: the K and V pools, same shape and dtype.
        k_scale, v_scale: their float32 scales for fp8 pools, else ``None``.
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> KVLayer:
        """The same layer on ``device`` (copies unless already there)."""
        return KVLayer(*(None if t is None else t.to(device) for t in (self.k_cache, self.v_cache, self.k_scale,
                                                                       self.v_scale)))
