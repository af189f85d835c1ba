"""Persistent decode inputs: the token ids, positions, slot mapping, sequence lengths and block tables of a
decode step as device tensors the engine owns, updated in place.

nano-vllm's ``model_runner.py`` and gpt-fast decode over static input tensors so that a step uploads only
what changed and a CUDA graph can replay over the same addresses; this module is kvchat's version. The
tensors are sized for :data:`BATCH_BUCKETS`' largest batch and the engine's context limit, and a step
reads views of them:

- **batch bucket** (:func:`batch_bucket`): where decode can run as CUDA graphs (CUDA with the Triton
  kernels, :mod:`kvchat.engine.decode_graphs`; also with graphs switched off, so both run the shapes the
  load-time warm-up compiled) a batch of 3 runs as 4 rows; a padded row has slot ``-1`` (the cache write skips
  it), length 0 (the Triton kernels read nothing and give zeros), token id and position 0, and its
  logits are dropped. Elsewhere rows are not padded: on a CPU the BLAS blocking changes with the row
  count (measured: the first 3 rows of a 3-row and a 4-row ``F.linear`` differ in the last bits), and
  without graphs padding buys nothing.
- **context bucket** (:func:`context_bucket`): the block table view's width, ``MIN_CONTEXT_BLOCKS``
  times a power of two (capped at the context limit). The Triton decode kernel chooses its split count
  from that width (``kernels/triton_decode.choose_num_splits``) and its row stride is the full table's,
  so every launch parameter is fixed within a (batch, context) bucket pair.

Per step the host writes ids, positions, slots and lengths into one staging tensor (pinned on CUDA) and
uploads it with one non-blocking copy; a block table row is uploaded only from its first changed entry
(a sequence's new block, a copy-on-write, a different sequence in that row); a row's exact sink
is copied in on the device only when the row gets another one (the engine makes one sink per first
token and never changes it, :meth:`kvchat.engine.runner.Engine.sink_kv`), so a step of a running chat
copies nothing but its ids, positions, slots and lengths. Nothing here reads device memory back: the one host sync of a
token is the sampled id (:mod:`kvchat.engine.sampling`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvchat.engine.block_manager import SeqBlocks

BATCH_BUCKETS = (1, 2, 4, 8)  # decode batch sizes a step is padded to on a GPU (the batching server's buckets)
MIN_CONTEXT_BLOCKS = 16  # 256 tokens at block size 16: one Triton decode split (triton_decode.MIN_TOKENS_PER_SPLIT)
_IDS, _POS, _SLOT, _LEN = range(4)  # rows of the staging tensor


def batch_bucket(num_seqs: int, padded: bool) -> int:
    """Rows a decode of ``num_seqs`` sequences runs: the smallest of :data:`BATCH_BUCKETS` that holds them
    when ``padded``, else ``num_seqs`` itself.

    Raises:
        ValueError: ``num_seqs`` outside 1 .. ``max(BATCH_BUCKETS)``.
    """
    if not 1 <= num_seqs <= BATCH_BUCKETS[-1]:
        raise ValueError(f"a decode step runs 1..{BATCH_BUCKETS[-1]} sequences, got {num_seqs}")
    return next(b for b in BATCH_BUCKETS if b >= num_seqs) if padded else num_seqs


def context_bucket(width: int, max_width: int, min_width: int = MIN_CONTEXT_BLOCKS) -> int:
    """Block-table columns a step reads for sequences of at most ``width`` blocks: ``min_width * 2**k``,
    the smallest that holds ``width``, capped at ``max_width`` (the context limit in blocks).

    Raises:
        ValueError: ``width`` outside 1 .. ``max_width``.
    """
    if not 1 <= width <= max_width:
        raise ValueError(f"a sequence of {width} blocks does not fit a block table of {max_width}")
    bucket = min_width
    while bucket < width:
        bucket *= 2
    return min(bucket, max_width)


def context_buckets(max_width: int, min_width: int = MIN_CONTEXT_BLOCKS) -> list[int]:
    """Every :func:`context_bucket` value for widths 1 .. ``max_width``, ascending."""
    buckets, b = [], min_width
    while b < max_width:
        buckets.append(b)
        b *= 2
    return [*buckets, max_width]


@dataclass(slots=True)
class DecodeRow:
    """One sequence of a decode step, as the host knows it.

    Attributes:
        blocks: the sequence's blocks (its block table covers ``position + 1`` tokens).
        token_id: the id run at ``position``.
        position: 0-based position of that token (tokens in the pool before it).
        slot: pool slot its K/V are written to.
        sink: its exact position-0 K/V (float32 ``[num_layers, num_kv_heads, head_dim]`` x2) or None.
    """

    blocks: SeqBlocks
    token_id: int
    position: int
    slot: int
    sink: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass(slots=True)
class DecodeView:
    """The step's inputs: views of :class:`DecodeBuffers` (the same storage every step).

    Attributes:
        input_ids, positions, slot_mapping: int64 ``[rows]``.
        seq_lens: int32 ``[rows]`` (the new token included; 0 in padded rows).
        block_table: int32 ``[rows, width]`` with the full table's row stride.
        cu_seqlens_q: int32 ``[rows + 1]``, ``0, 1, .., rows``.
        sink: float32 ``[rows, num_layers, num_kv_heads, head_dim]`` x2, or None.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    sink: tuple[torch.Tensor, torch.Tensor] | None


class DecodeBuffers:
    """The engine's decode input tensors (see module doc).

    Attributes:
        step: int64 ``[4, max_rows]`` on the device: ids, positions, slots, lengths (uploaded each step).
        seq_lens: int32 ``[max_rows]`` (``step``'s lengths, cast on the device).
        block_table: int32 ``[max_rows, max_blocks]``.
        sink: float32 ``[max_rows, num_layers, num_kv_heads, head_dim]`` x2, or None without an exact sink.
        sink_rows: the sink each row of ``sink`` holds (the tuple it was copied from, by identity), or None.
        uploads: block-table entries uploaded so far (a counter the tests read).
    """

    def __init__(self, max_blocks: int, sink_shape: tuple[int, int, int] | None, device: torch.device,
                 max_rows: int = BATCH_BUCKETS[-1]):
        """``max_blocks``: the context limit in blocks. ``sink_shape``: ``(num_layers, num_kv_heads, head_dim)``
        of the exact sink, None without one."""
        pin = device.type == "cuda"  # pin_memory needs CUDA
        self.device, self.max_rows, self.max_blocks = device, max_rows, max_blocks
        self._host = torch.zeros((4, max_rows), dtype=torch.long, pin_memory=pin)
        self._host_np = self._host.numpy()
        self._host_table = torch.zeros((max_rows, max_blocks), dtype=torch.int32, pin_memory=pin)
        self._host_table_np = self._host_table.numpy()
        self.step = torch.zeros((4, max_rows), dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(max_rows, dtype=torch.int32, device=device)
        self.block_table = torch.zeros((max_rows, max_blocks), dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(max_rows + 1, dtype=torch.int32, device=device)
        self.sink = None
        if sink_shape is not None:
            self.sink = tuple(torch.zeros((max_rows, *sink_shape), device=device) for _ in range(2))
        self.sink_rows: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * max_rows
        self._owners: list[SeqBlocks | None] = [None] * max_rows
        self._tables: list[list[int]] = [[] for _ in range(max_rows)]
        self._uploaded: torch.cuda.Event | None = None
        self.uploads = 0

    def _table_row(self, i: int, blocks: SeqBlocks) -> None:
        """Upload row ``i``'s block-table entries from the first one that differs from what it holds."""
        table, held = blocks.block_table, self._tables[i]
        if self._owners[i] is blocks and len(table) == len(held) and table == held:
            return
        first = 0
        if self._owners[i] is blocks:
            n = min(len(table), len(held))
            while first < n and table[first] == held[first]:
                first += 1
        self._owners[i], self._tables[i] = blocks, list(table)
        if first < len(table):
            self._host_table_np[i, first:len(table)] = table[first:]
            self.block_table[i, first:len(table)].copy_(self._host_table[i, first:len(table)], non_blocking=True)
            self.uploads += len(table) - first

    def load(self, rows: list[DecodeRow], bucket: int, width: int) -> DecodeView:
        """Write the step's rows (and padding up to ``bucket`` rows) into the buffers; the views to run.

        ``width``: block-table columns of the view (:func:`context_bucket`), at least every row's table.
        No device-to-host read; on CUDA the host waits only for the previous step's upload (long done:
        its sampled id has been read since) before it rewrites the pinned staging memory.
        """
        if self._uploaded is not None:
            self._uploaded.synchronize()
        host, n = self._host_np, len(rows)
        host[_IDS, :n] = [r.token_id for r in rows]
        host[_POS, :n] = [r.position for r in rows]
        host[_SLOT, :n] = [r.slot for r in rows]
        host[_LEN, :n] = [r.position + 1 for r in rows]
        host[:, n:] = 0
        host[_SLOT, n:] = -1  # padded rows: nothing written, nothing read (length 0)
        self.step.copy_(self._host, non_blocking=True)  # all of it: a contiguous pinned source, one copy
        for i, r in enumerate(rows):
            self._table_row(i, r.blocks)
            if r.sink is not None and self.sink is not None and self.sink_rows[i] is not r.sink:
                self.sink[0][i].copy_(r.sink[0])  # device to device, 46 KB a row for SmolLM2
                self.sink[1][i].copy_(r.sink[1])
                self.sink_rows[i] = r.sink
        self.seq_lens.copy_(self.step[_LEN])
        if self.device.type == "cuda":
            self._uploaded = torch.cuda.Event()
            self._uploaded.record()
        return self.view(bucket, width, with_sink=any(r.sink is not None for r in rows))

    def view(self, bucket: int, width: int, with_sink: bool) -> DecodeView:
        """The views a step of ``bucket`` rows over ``width`` block-table columns reads (no copy)."""
        sink = tuple(s[:bucket] for s in self.sink) if with_sink and self.sink is not None else None
        return DecodeView(self.step[_IDS, :bucket], self.step[_POS, :bucket], self.step[_SLOT, :bucket],
                          self.seq_lens[:bucket], self.block_table[:bucket, :width], self.cu_seqlens_q[: bucket + 1],
                          sink)
