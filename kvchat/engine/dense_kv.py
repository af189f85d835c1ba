"""A contiguous, dequantized copy of one sequence's K/V: the CPU attention read path of the torch layers' chunks.

The paged reference kernels gather a sequence's blocks and dequantize them at
every forward, so a CPU chunk over 4,096 cached tokens would pay two full gathers per
layer. This copy holds, per layer, float32 K/V ``[num_kv_heads, capacity,
head_dim]`` of exactly the values the pool stores: new tokens are read back
from the pool after :func:`kvchat.kernels.dispatch.write_kv` (never taken from the
pre-quantization K/V), so attention sees the same numbers as through the
block table. Decode steps and chunks of up to
:data:`kvchat.model.int8_scheme.COMPILED_LAYER_MAX_TOKENS` tokens read the pool itself where the compiled CPU
kernels run (:mod:`kvchat.kernels.cpu_attention`: a quarter of this copy's bytes for fp8, half for 16-bit pools)
and leave the copy as it was (its staleness check sees their writes); elsewhere decode steps read it too, and
append their token.

Staleness: :attr:`KVPool.block_writes` counts writes per block. The copy
records each block's id and count when it reads it and trusts a token only
while both are unchanged, so a rollback, a restore, a fork's copy-on-write
or a block reused by another sequence makes it re-read from the first
changed block. The engine keeps one copy, for the sequence it ran last.
"""

from __future__ import annotations

import torch

from kvchat.engine.block_manager import BlockManager, SeqBlocks
from kvchat.engine.kv_pool import KVPool
from kvchat.kernels import dispatch
from kvchat.store.snapshot import ChunkData

MIN_CAPACITY = 256  # tokens; capacity is a multiple of it
HEADROOM_TOKENS = 512  # grown by this much beyond the need: a question after a prefill, or 512 decode steps, fit
# without a copy, and a resumed 4,096-token chat does not fault in pages for 8,192 (doubling would).
PREALLOCATE_BYTES = 512 * 2**20  # the engine's copy is allocated and touched at load up to this size (preallocate)


class DenseKV:
    """One sequence's K/V, dequantized and contiguous (see module doc).

    Attributes:
        k, v: float32 ``[num_layers, num_kv_heads, capacity, head_dim]``.
        length: leading tokens that are valid.
    """

    def __init__(self, pool: KVPool, blocks: BlockManager):
        """``blocks``: the pool's block manager (token → slot arithmetic, :meth:`BlockManager.slots`)."""
        self.pool = pool
        self.blocks = blocks
        spec = pool.spec
        self._shape = (spec.num_layers, spec.num_kv_heads, 0, spec.head_dim)
        self.k = torch.empty(self._shape, device=pool.k.device)
        self.v = torch.empty(self._shape, device=pool.k.device)
        self.length = 0
        self._owner: SeqBlocks | None = None
        self._blocks: list[int] = []
        self._writes: list[int] = []
        self._sink: tuple[torch.Tensor, torch.Tensor] | None = None

    def _valid_prefix(self, seq: SeqBlocks, limit: int) -> int:
        """Tokens ``< limit`` whose blocks are unchanged since they were read."""
        if self._owner is not seq:
            return 0
        bs = self.pool.spec.block_size
        n = min(self.length, limit)
        nb = -(-n // bs)
        table, writes = seq.block_table[:nb], self.pool.block_writes
        if table == self._blocks[:nb] and [writes[b] for b in table] == self._writes[:nb]:
            return n
        i = 0
        while i < nb and i < len(self._blocks) and table[i] == self._blocks[i] and writes[table[i]] == self._writes[i]:
            i += 1
        return min(n, i * bs)

    @property
    def fp32_bytes_per_token(self) -> int:
        """Bytes of one token's K and V over all layers (float32)."""
        layers, heads, _, dim = self._shape
        return 2 * layers * heads * dim * 4

    def preallocate(self, max_tokens: int) -> int:
        """Allocate room for ``max_tokens`` tokens (no sequence is longer: the engine's context limit), at most
        :data:`PREALLOCATE_BYTES` (rounded up to :data:`MIN_CAPACITY` tokens), and touch every page now;
        returns the capacity in tokens.

        Called once at load (:func:`kvchat.runtime.load_runtime`), before any sequence runs. A fresh
        process's first restore otherwise writes into freshly mapped memory and pays one page fault per 4 KiB inside the time to first token
        (measured, a 4,096-token restore in fresh processes, 2 threads: 68 ms restore / 214-220 ms TTFT
        with the copy touched at load vs 92-105 ms / 232-252 ms without; touching 189 MB took 32-50 ms of
        the load). llama.cpp likewise allocates and clears its whole KV buffer when it creates a context.
        """
        tokens = min(max_tokens, PREALLOCATE_BYTES // self.fp32_bytes_per_token)
        cap = max(MIN_CAPACITY, -(-tokens // MIN_CAPACITY) * MIN_CAPACITY)
        if cap > self.k.shape[2]:
            self._grow(cap)
            self.k.zero_()
            self.v.zero_()
        return self.k.shape[2]

    def _reserve(self, num_tokens: int) -> None:
        if num_tokens > self.k.shape[2]:
            self._grow(-(-(num_tokens + HEADROOM_TOKENS) // MIN_CAPACITY) * MIN_CAPACITY)

    def _grow(self, new_cap: int) -> None:
        """Reallocate K/V with ``new_cap`` tokens of capacity, keeping the valid tokens."""
        shape = (self._shape[0], self._shape[1], new_cap, self._shape[3])
        for name in ("k", "v"):
            old = getattr(self, name)
            new = torch.empty(shape, device=old.device)
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def sync(self, seq: SeqBlocks, start: int, end: int, sink: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Before a forward of tokens ``[start, end)``: make ``[0, start)`` valid.

        Reads from the pool, for all layers at once, the tokens that are
        missing or whose blocks changed. ``seq.block_table`` must cover
        ``end`` tokens. ``sink``: the sequence's exact position-0 K/V
        (float32 ``[num_layers, num_kv_heads, head_dim]`` x2, see
        :meth:`kvchat.engine.runner.Engine.sink_kv`), kept in row 0 instead of the
        pool's quantized values; the same for every forward of a sequence.
        """
        valid = self._valid_prefix(seq, start)
        self._sink = sink
        self._owner = seq
        self.length = valid
        self._reserve(end)
        if valid < start:
            slots = torch.tensor(self.blocks.slots(seq, valid, start), dtype=torch.long, device=self.k.device)
            pool = self.pool
            for dst, cache, scale in ((self.k, pool.k, pool.k_scale), (self.v, pool.v, pool.v_scale)):
                dispatch.read_slots(cache, scale, slots, out=dst[:, :, valid:start].transpose(1, 2))
            if valid == 0 and sink is not None:
                self.k[:, :, 0], self.v[:, :, 0] = sink
        self.length = start

    def fill(self, start: int, data: ChunkData, offset: int, n: int) -> None:
        """During a restore (one the next torch-layer chunk reads: see
        :meth:`kvchat.engine.persistence.KVPersist.restore`), after :meth:`sync` reserved the tokens: dequantize chunk rows ``offset ..
        offset + n`` (all layers) straight into positions ``start .. start + n - 1``.

        The restore writes the same rows into the pool, so these are exactly
        the values :func:`kvchat.kernels.dispatch.read_slots` would read back (the same
        bytes through the same :func:`kvchat.kernels.dispatch.dequantize_into`), without
        a second pass over the pool. Several reader threads may fill disjoint
        ranges at once; :meth:`finish` then marks the restored tokens valid.

        Args:
            data: a chunk's K/V ``[num_layers, tokens, num_kv_heads, head_dim]`` in the pool dtype, fp32 scales
                ``[num_layers, tokens, num_kv_heads]`` for fp8 (not modified).
        """
        rows = slice(offset, offset + n)
        for dst, values, scale in ((self.k, data.k, data.k_scale), (self.v, data.v, data.v_scale)):
            dispatch.dequantize_into(values[:, rows], None if scale is None else scale[:, rows],
                                    out=dst[:, :, start : start + n].transpose(1, 2))
        if start == 0 and self._sink is not None:
            self.k[:, :, 0], self.v[:, :, 0] = self._sink

    def append(self, layer: int, slots: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """After ``write_kv`` of layer ``layer``: copy the new tokens in, return K/V so far.

        Args:
            slots: int64 ``[T]`` pool slots of the new tokens (positions ``start .. start + T - 1``).
        Returns:
            ``(k, v)`` float32 ``[num_kv_heads, start + T, head_dim]`` views.
        """
        kv = self.pool.layer(layer)
        return self.put(layer, start, dispatch.read_slots(kv.k_cache, kv.k_scale, slots),
                        dispatch.read_slots(kv.v_cache, kv.v_scale, slots))

    def put(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`append` with the new tokens already read back from the pool: float32 ``k``, ``v``
        ``[T, num_kv_heads, head_dim]`` (a batched decode reads every sequence's new token at once)."""
        end = start + k.shape[0]
        self.k[layer, :, start:end] = k.transpose(0, 1)
        self.v[layer, :, start:end] = v.transpose(0, 1)
        if start == 0 and self._sink is not None:
            self.k[layer, :, 0], self.v[layer, :, 0] = self._sink[0][layer], self._sink[1][layer]
        return self.k[layer, :, :end], self.v[layer, :, :end]

    def finish(self, seq: SeqBlocks, end: int) -> None:
        """After a forward: tokens ``[0, end)`` are valid; record the blocks' write counts."""
        bs = self.pool.spec.block_size
        self._blocks = seq.block_table[: -(-end // bs)]
        self._writes = [self.pool.block_writes[b] for b in self._blocks]
        self.length = end
