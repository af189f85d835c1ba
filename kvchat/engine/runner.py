"""The model runner: owns the device, the weights, the KV pool and the block manager.

The only module that runs the model. A sequence is a token list plus its
``SeqBlocks``; :meth:`Engine.prefill` computes the tokens not yet in the pool
in chunks whose boundaries fall on segment boundaries (plus every
``chunk_tokens`` inside a segment), so a cold run and a resumed run perform
the same computations; :meth:`Engine.decode` runs one token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from kvchat import kernels, settings
from kvchat.engine.block_manager import BlockManager, SeqBlocks
from kvchat.engine.cache_identity import engine_identity, sink_supported
from kvchat.model.config import ModelConfig
from kvchat.engine.dense_kv import DenseKV
from kvchat.engine.kv_pool import KVCacheSpec, KVPool
from kvchat.engine.calibration import KVCalibration
from kvchat.model.quant import int8_path, quantize_linears
from kvchat.model.transformer import AttnMetadata, Transformer, rope_inv_freq

DEFAULT_CPU_POOL_BYTES = 512 * 2**20
GPU_POOL_FRACTION = 0.5
PREFILL_CHUNK_TOKENS = 512
SMALL_MODEL_PARAMS = 2_000_000_000
DEFAULT_PREFILL_TOKENS_PER_S = 150.0  # until measured; CPU-conservative


class ContextOverflowError(ValueError):
    """A sequence would exceed the model's context length."""


@dataclass(slots=True)
class PrefillResult:
    """What one prefill did.

    Attributes:
        logits: float32 ``[vocab_size]`` for the last token.
        prefilled_tokens: tokens run through the model.
        prefill_ms: wall time of those forwards, ms.
    """

    logits: torch.Tensor
    prefilled_tokens: int
    prefill_ms: float


def compute_dtype(device: torch.device, num_params: int) -> torch.dtype:
    """bf16 on GPU; on CPU fp32 for small models (CPUs without bf16 units are
    several times slower in bf16), bf16 for large ones (never an fp32 blow-up)."""
    if device.type == "cuda" or num_params > SMALL_MODEL_PARAMS:
        return torch.bfloat16
    return torch.float32


def chunk_plan(start: int, end: int, boundaries: Sequence[int], chunk_tokens: int = PREFILL_CHUNK_TOKENS) -> list[tuple[int, int]]:
    """Split tokens ``[start, end)`` into prefill chunks.

    Cuts at every segment boundary and every ``chunk_tokens`` tokens after a
    boundary, so the plan for ``[b, end)`` with ``b`` a boundary is a suffix
    of the plan for ``[0, end)``.
    """
    cuts = sorted({0, *boundaries})
    points = set()
    for i, seg_start in enumerate(cuts):
        seg_end = cuts[i + 1] if i + 1 < len(cuts) else end
        points.update(range(seg_start, seg_end, chunk_tokens))
    points = sorted(p for p in points if start < p < end)
    edges = [start, *points, end]
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]


def last_cut(num_tokens: int, boundaries: Sequence[int], chunk_tokens: int = PREFILL_CHUNK_TOKENS) -> int:
    """The largest chunk edge of :func:`chunk_plan` at or below ``num_tokens``.

    Reused K/V (prefix hits, disk restores) are trimmed to such an edge, so
    the tokens after it are computed in exactly the chunks a cold run uses
    and every token's K/V are bit-identical whichever way they were obtained.
    """
    seg = max((b for b in (0, *boundaries) if b <= num_tokens), default=0)
    return seg + (num_tokens - seg) // chunk_tokens * chunk_tokens


class Engine:
    """Weights + paged KV pool + block manager for one model on one device.

    Raises:
        kvchat.settings.SettingError: a bad ``KVCHAT_DEVICE`` (used when ``device`` is None),
            ``KVCHAT_KV_BUDGET_MB`` (when ``pool_bytes`` is None) or ``KVCHAT_ATTENTION``.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        model_fingerprint: str,
        *,
        kv_dtype: str = "fp8",
        pool_bytes: int | None = None,
        device: torch.device | str | None = None,
        name: str = "",
        dense_kv: bool | None = None,
        calibration: KVCalibration | None = None,
        exact_sink: bool = True,
        weight_format: str | None = None,
    ):
        """``weight_format``: ``fp32|bf16|int8`` (:data:`kvchat.engine.cache_identity.WEIGHT_FORMATS`; int8:
        the loaded linear layers quantized by :func:`kvchat.model.quant.quantize_linears`, stored per model);
        None: fp32 on a CPU for small models, else bf16 (:func:`compute_dtype`)."""
        self.cfg = cfg
        self.name = name
        self.device = torch.device(device) if device is not None else settings.device()
        num_params = sum(t.numel() for t in weights.values())
        legacy = "fp32" if compute_dtype(self.device, num_params) == torch.float32 else "bf16"
        self.weight_format = weight_format or legacy
        self.dtype = torch.bfloat16 if self.weight_format == "bf16" else torch.float32
        t0 = time.perf_counter()
        with torch.device(self.device):
            model = Transformer(cfg).to(self.dtype)
        model.load_hf_state_dict(weights)
        if self.weight_format == "int8":
            quantize_linears(model, int8_path(model_fingerprint))
        model.inv_freq = rope_inv_freq(cfg).to(self.device)  # keep fp32 after the dtype cast
        self.model = model.eval()
        self.spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv_dtype)
        self.pool = KVPool.from_budget(self.spec, pool_bytes or self._default_pool_bytes(), self.device)
        fp8 = kv_dtype == "fp8"
        self.calibration = calibration if fp8 else None
        if self.calibration is not None:
            for layer, shift in zip(model.layers, self.calibration.k_mean):
                layer.self_attn.k_shift = shift.to(self.device, self.dtype)
        self.exact_sink = fp8 and exact_sink and sink_supported(self.pool.k)
        self._sinks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.scale_scheme, self.cache_fingerprint = engine_identity(
            model_fingerprint, kv_dtype, self.calibration.digest if self.calibration else None, self.exact_sink,
            self.spec.block_size, self.weight_format)
        self.blocks = BlockManager(self.pool.num_blocks, self.spec.block_size, bytes.fromhex(self.cache_fingerprint))
        if dense_kv is None:
            dense_kv = self.device.type == "cpu" and kernels.backend_for(self.pool.k) == "torch"
        self.dense = DenseKV(self.pool, self.blocks) if dense_kv else None
        self.load_ms = (time.perf_counter() - t0) * 1e3
        self.prefill_tokens_per_s = DEFAULT_PREFILL_TOKENS_PER_S

    def _default_pool_bytes(self) -> int:
        mb = settings.kv_budget_mb()
        if mb is not None:
            return int(mb * 2**20)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * GPU_POOL_FRACTION)
        return DEFAULT_CPU_POOL_BYTES

    @property
    def max_context(self) -> int:
        """Longest sequence in tokens (model limit, capped by the pool)."""
        return min(self.cfg.max_position_embeddings, self.pool.capacity_tokens)

    @property
    def context_limit_text(self) -> str:
        """``the context limit is N tokens`` plus why, when the pool (not the model) sets it."""
        text = f"the context limit is {self.max_context} tokens"
        if self.pool.capacity_tokens < self.cfg.max_position_embeddings:
            text += f" (the KV pool holds {self.pool.capacity_tokens}; raise KVCHAT_KV_BUDGET_MB)"
        return text

    def check_fits(self, num_tokens: int) -> None:
        """Raise :class:`ContextOverflowError` if ``num_tokens`` exceeds :attr:`max_context`."""
        if num_tokens > self.max_context:
            raise ContextOverflowError(f"conversation would be {num_tokens} tokens; {self.context_limit_text}")

    @torch.no_grad()
    def sink_kv(self, token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact (unquantized) K/V of ``token_id`` at position 0, every layer: float32 ``[num_layers, num_kv_heads, head_dim]`` x2.

        Position 0 is the attention sink (Xiao et al. 2023, "Efficient
        Streaming Language Models with Attention Sinks"): every query gives
        it a large share of its attention, so its fp8 rounding error weighs on
        every score. With ``exact_sink`` all attention reads take position 0
        from here instead of the pool (the pool and snapshots keep the
        quantized values, unchanged in layout). A causal model's position 0
        depends on its token alone, so the values are computed once per
        token and process by a one-token forward (K already centred) and are
        the same in every process and for every sequence: cold, resumed and
        shared prefixes read identical numbers.
        """
        sink = self._sinks.get(token_id)
        if sink is None:
            shape = (self.cfg.num_layers, self.cfg.num_kv_heads, self.cfg.head_dim)
            sink = (torch.zeros(shape, device=self.device), torch.zeros(shape, device=self.device))
            seq = SeqBlocks()
            try:
                self._forward(seq, [token_id], 0, 1, register=False, sink=sink, capture_sink=True)
            finally:
                self.release(seq)
            self._sinks[token_id] = sink
        return sink

    def prepare_write(self, seq: SeqBlocks, start: int, end: int, dense: DenseKV | None = None,
                      sink: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """The write protocol, the one place of it: before tokens ``[start, end)`` of ``seq`` are written.

        Reserve the slots up to ``end`` (shared or cached blocks are copied on
        write first), let ``dense`` (the CPU read path's copy) catch up with the
        pool as it still is, then count the blocks about to be written
        (:meth:`KVPool.mark_written`), so a stale dense copy is detected.
        """
        self.pool.copy_blocks(self.blocks.reserve(seq, end))
        if dense is not None:
            dense.sync(seq, start, end, sink)
        self.pool.mark_written(self.blocks.block_span(seq, start, end))

    def _forward(self, seq: SeqBlocks, token_ids: Sequence[int], start: int, end: int, register: bool = True,
                 sink: tuple[torch.Tensor, torch.Tensor] | None = None, capture_sink: bool = False) -> torch.Tensor:
        """Write K/V for tokens ``[start, end)``; return their hidden states ``[end - start, hidden]``.

        ``register``: full blocks enter the prefix cache (see :meth:`BlockManager.commit`).
        ``sink``/``capture_sink``: used by :meth:`sink_kv` (which fills ``sink``
        layer by layer, on the paged path so the sequence's dense copy is kept).
        """
        if sink is None and self.exact_sink:
            sink = self.sink_kv(token_ids[0])
        dense = None if capture_sink else self.dense
        self.prepare_write(seq, start, end, dense, sink)
        dev = self.device
        ids = torch.tensor(token_ids[start:end], dtype=torch.long, device=dev)
        positions = torch.arange(start, end, device=dev)
        slots = torch.tensor(self.blocks.slots(seq, start, end), dtype=torch.long, device=dev)
        meta = AttnMetadata(
            slot_mapping=slots,
            block_table=torch.tensor([seq.block_table], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([end], dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor([0, end - start], dtype=torch.int32, device=dev),
            is_decode=end - start == 1 and start > 0,
            dense=dense,
            q_start=start,
            sink=sink,
            capture_sink=capture_sink,
        )
        hidden = self.model(ids, positions, meta, self.pool)
        if dense is not None:
            dense.finish(seq, end)
        self.blocks.commit(seq, token_ids, end, register)
        return hidden

    @torch.inference_mode()
    def prefill(
        self,
        seq: SeqBlocks,
        token_ids: Sequence[int],
        boundaries: Sequence[int] = (),
        progress: Callable[[int, int], None] | None = None,
    ) -> PrefillResult:
        """Compute every token of ``token_ids`` not yet in the pool; return last-token logits.

        At least the last token is always computed (a full prefix hit still
        needs logits); its block is copied on write if shared.

        Args:
            seq: the sequence's blocks (``seq.num_computed`` tokens already in the pool).
            token_ids: the whole sequence, ids.
            boundaries: segment start offsets (tokens) for the chunk plan.
            progress: called with ``(done_tokens, total_tokens)`` after each chunk.
        Raises:
            ContextOverflowError: the sequence exceeds the context limit.
            PoolFullError: the pool cannot hold it.
        """
        self.check_fits(len(token_ids))
        start = min(seq.num_computed, len(token_ids) - 1)
        seq.num_computed = start
        t0 = time.perf_counter()
        hidden = None
        for a, b in chunk_plan(start, len(token_ids), boundaries):
            hidden = self._forward(seq, token_ids, a, b)
            if progress:
                progress(b - start, len(token_ids) - start)
        logits = self.model.logits(hidden[-1:])[0]
        ms = (time.perf_counter() - t0) * 1e3
        if len(token_ids) - start >= 64:
            self.prefill_tokens_per_s = (len(token_ids) - start) / (ms / 1e3)
        return PrefillResult(logits, len(token_ids) - start, ms)

    @torch.inference_mode()
    def score(self, seq: SeqBlocks, token_ids: Sequence[int], boundaries: Sequence[int] = ()) -> torch.Tensor:
        """Teacher-forced logits for every position not yet in the pool.

        Same chunk plan and pool path as :meth:`prefill`; each chunk attends
        through the pool, so every position sees K/V as stored (quantized).

        Returns:
            float32 ``[len(token_ids) - seq.num_computed, vocab_size]``; row i
            predicts token ``seq.num_computed + i + 1``.
        """
        self.check_fits(len(token_ids))
        start = seq.num_computed
        rows = [self.model.logits(self._forward(seq, token_ids, a, b)) for a, b in chunk_plan(start, len(token_ids), boundaries)]
        return torch.cat(rows)

    @torch.inference_mode()
    def decode(self, seq: SeqBlocks, token_ids: Sequence[int]) -> torch.Tensor:
        """Run the last id of ``token_ids`` (all earlier ones in the pool); float32 logits ``[vocab_size]``.

        Decode's K/V are provisional: one token at a time they differ in the
        last bits from what a prefill chunk computes, so their blocks stay out
        of the prefix cache and :meth:`kvchat.engine.session.Session.send` recomputes
        the answer as a chunk once it ends (see :func:`last_cut`).
        """
        n = len(token_ids)
        self.check_fits(n)
        hidden = self._forward(seq, token_ids, n - 1, n, register=False)
        return self.model.logits(hidden)[0]

    def release(self, seq: SeqBlocks) -> None:
        """Free a sequence's blocks (they stay in the prefix cache until reused)."""
        self.blocks.free_seq(seq)
