"""The model runner: owns the device, the weights, the KV pool and the block manager.

The only module that runs the model. A sequence is a token list plus its
``SeqBlocks``; :meth:`Engine.prefill_steps` computes the tokens not yet in the
pool in chunks whose boundaries fall on segment boundaries (plus every
``chunk_tokens`` inside a segment), so a cold run and a resumed run perform
the same computations; :meth:`Engine.decode` runs one token. The engine loop
(:mod:`kvchat.engine.loop`) drives them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from kvchat import settings
from kvchat.context_fit import check_fits
from kvchat.device import activate, check_device, device_guard
from kvchat.engine.block_manager import BlockManager, PoolFullError, SeqBlocks
from kvchat.engine.cache_identity import FORMAT_COMPUTE, CacheIdentity, compute_key, int8_prefill_enabled
from kvchat.engine.calibration import KVCalibration
from kvchat.engine.decode_buffers import BATCH_BUCKETS, DecodeBuffers, DecodeRow, batch_bucket, context_bucket, context_buckets
from kvchat.engine.decode_graphs import DecodeGraphs
from kvchat.engine.dense_kv import DenseKV
from kvchat.engine.execution_plan import ExecutionPlan, plan_execution
from kvchat.engine.inference import inference
from kvchat.engine.kv_pool import KVCacheSpec, KVPool
from kvchat.engine.pool_size import PoolPlan, activation_peak_bytes, plan_pool
from kvchat.engine.sequence import DecodeStep, PrefillChunk
from kvchat.engine.timing import DeviceTimer
from kvchat.kernels import cpu_int8_int8, dispatch
from kvchat.kernels.cpu_int8 import small_rows_kernel
from kvchat.kernels.warmup import warm_up
from kvchat.model.compiled_decode import compiled_decode
from kvchat.model.config import ModelConfig
from kvchat.model.int8_scheme import COMPILED_LAYER_MAX_TOKENS
from kvchat.model.quant import Int8GroupLinear, quantized_path, weight_scheme
from kvchat.model.quantized_load import QuantizingLoad
from kvchat.model.transformer import AttnMetadata, Block, build_model
from kvchat.model.weights import weight_reader

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}  # KVCHAT_DTYPE / --dtype names
FORMAT_COMPUTE_DTYPES = {f: COMPUTE_DTYPES[n] for f, n in FORMAT_COMPUTE.items()}  # see cache_identity.FORMAT_COMPUTE
PREFILL_CHUNK_TOKENS = 512
SMALL_MODEL_PARAMS = 2_000_000_000
DEFAULT_PREFILL_TOKENS_PER_S = 150.0  # until measured; CPU-conservative


@dataclass(slots=True)
class PrefillResult:
    """What one prefill did.

    Attributes:
        logits: float32 ``[vocab_size]`` for the last token.
        prefilled_tokens: tokens run through the model.
        prefill_ms: time of those forwards on the device (synced: :class:`kvchat.engine.timing.DeviceTimer`), ms.
    """

    logits: torch.Tensor
    prefilled_tokens: int
    prefill_ms: float


def compute_dtype(device: torch.device, num_params: int, name: str = "auto") -> torch.dtype:
    """``name`` (``bf16|fp16|fp32``, see :data:`COMPUTE_DTYPES`) or, for ``auto``: bf16 on GPU; on CPU fp32
    for small models (CPUs without bf16 units are several times slower in bf16), bf16 for large ones
    (never an fp32 blow-up)."""
    if name != "auto":
        return COMPUTE_DTYPES[name]
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


def prefill_start(num_computed: int, num_tokens: int, boundaries: Sequence[int]) -> int:
    """Where a prefill of ``num_tokens`` tokens starts when ``num_computed`` are resident: at a cold chunk
    edge (:func:`last_cut`), and before the last token, which is always computed for its logits."""
    return last_cut(min(num_computed, num_tokens - 1), boundaries)


class Engine:
    """Weights + paged KV pool + block manager for one model on one device.

    ``weights``: a ``{name: tensor}`` mapping or a :mod:`kvchat.model.weights` reader (streamed into
    a model built on the meta device, :func:`kvchat.model.transformer.build_model`). ``dtype``: the
    compute dtype name (None: ``KVCHAT_DTYPE``). ``calibration``: a :class:`KVCalibration`, or a callable
    given the engine while its model loads (before its pool exists) that returns one
    (:func:`kvchat.runtime.ensure_calibration` computes it on this engine's unquantized weights,
    :meth:`unquantized_layers`).

    Raises:
        kvchat.settings.SettingError: a bad ``KVCHAT_DEVICE`` (used when ``device`` is None),
            ``KVCHAT_KV_BUDGET_MB`` (when ``pool_bytes`` is None), ``KVCHAT_DTYPE``, ``KVCHAT_RESIDENT_CHATS``
            or ``KVCHAT_ATTENTION``.
        kvchat.device.DeviceError: ``device`` names a CUDA device that does not exist here.
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
        calibration: KVCalibration | Callable[["Engine"], KVCalibration] | None = None,
        exact_sink: bool = True,
        dtype: str | None = None,
        weight_format: str | None = None,
        progress: Callable[[str, int, int], None] | None = None,
        int8_prefill: str | None = None,
    ):
        """``weight_format``: ``fp32|bf16|int8|int4`` (:data:`kvchat.engine.cache_identity.WEIGHT_FORMATS`; int8
        and int4: the linear layers loaded one at a time and quantized, or read quantized from the model's stored
        file, by :class:`kvchat.model.quantized_load.QuantizingLoad`, never the fp32 model whole);
        None: unquantized, bf16 where :func:`compute_dtype`'s ``auto`` or ``dtype`` says bf16, else fp32.
        ``progress``: the start's steps that take long, as ``(text, done, total)`` (on a GPU's first start:
        compiling the Triton kernels, :func:`kvchat.kernels.warmup.warm_up`).
        ``int8_prefill``: ``auto|int8|float`` (None: ``KVCHAT_INT8_PREFILL``): int8 weights' prefill chunks with
        int8 activations where :func:`kvchat.engine.cache_identity.int8_prefill_enabled`.
        ``dtype``: a :data:`COMPUTE_DTYPES` name or ``auto`` (None: ``KVCHAT_DTYPE``); ``auto`` computes in
        :data:`FORMAT_COMPUTE_DTYPES` of the weight format, and any other choice enters the cache fingerprint.

        Raises:
            ValueError: int8 or int4 weights with a compute dtype other than fp32; int4 weights where their
                compiled kernel is not available.
            kvchat.device.DeviceError: ``device`` is a CUDA device that does not exist.
        """
        self.cfg = cfg
        self.name = name
        self.device = check_device(device if device is not None else settings.device())
        activate(self.device)
        weights = weight_reader(weights)
        num_params = weights.num_params()
        dtype_name = dtype or settings.compute_dtype()
        if weight_format is None:  # unquantized, as auto computes (or bf16 weights for a bf16 override, as the loader)
            auto_bf16 = compute_dtype(self.device, num_params) == torch.bfloat16
            weight_format = "bf16" if auto_bf16 or dtype_name == "bf16" else "fp32"
        self.weight_format = weight_format
        implied = FORMAT_COMPUTE_DTYPES[self.weight_format]  # what the weight format computes in unless overridden
        self.dtype = implied if dtype_name == "auto" else COMPUTE_DTYPES[dtype_name]
        if self.weight_format in ("int8", "int4") and self.dtype != torch.float32:
            raise ValueError(f"{self.weight_format} weights compute in fp32 (int8: bf16 only at torch's int8 kernel's "
                             f"input, where it runs); drop --dtype {dtype_name}")
        timer = DeviceTimer(self.device).start()
        self.spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv_dtype)
        fp8 = kv_dtype == "fp8"
        # the int8 kernel, chosen once: it decides the layers' scheme and the fingerprint's name alike
        self.int8_kernel = small_rows_kernel() if self.weight_format == "int8" else None
        self._unquantized: Iterator[Block] | None = None
        if self.weight_format in ("int8", "int4"):  # layer by layer, never the fp32 model whole
            bits = 4 if self.weight_format == "int4" else 8
            _, scheme = weight_scheme(bits, self.int8_kernel)
            load = QuantizingLoad(cfg, weights, self.device, bits, self.int8_kernel,
                                  quantized_path(model_fingerprint, scheme))
            self.model = load.model
            if callable(calibration):  # on the unquantized weights, each layer quantized once it has run
                self._unquantized = load.unquantized_layers()
                calibration = calibration(self) if fp8 else None
                self._unquantized = None
            self.model = model = load.finish()
        else:
            self.model = model = build_model(cfg, weights, self.device, self.dtype)
            if callable(calibration):  # one calibration per model, on its weights as loaded
                calibration = calibration(self) if fp8 else None
        weights.close()
        self.int8_prefill = self.device.type == "cpu" and int8_prefill_enabled(
            int8_prefill or settings.int8_prefill(), self.int8_kernel)
        if self.int8_prefill:
            for layer in model.modules():
                if isinstance(layer, Int8GroupLinear) and cpu_int8_int8.takes(layer.out_features, layer.in_features):
                    layer.integer_prefill = True
        if pool_bytes is not None:
            self.pool_plan = PoolPlan(pool_bytes, f"KV pool {pool_bytes / 2**20:,.0f} MiB (set by the caller)")
        else:  # after the weights and any calibration: on CUDA it reads the memory left
            self.pool_plan = plan_pool(self.spec, cfg.max_position_embeddings, self.device,
                                       lambda: activation_peak_bytes(model, cfg, self.device, PREFILL_CHUNK_TOKENS))
        self.pool = KVPool.from_budget(self.spec, self.pool_plan.bytes, self.device)
        self.calibration = calibration if fp8 else None
        if self.calibration is not None:
            for layer, shift in zip(model.layers, self.calibration.k_mean):
                layer.self_attn.k_shift = shift.to(self.device, self.dtype)
        self.exact_sink = fp8 and exact_sink  # every attention backend reads it
        self._sinks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        max_blocks = -(-self.max_context // self.spec.block_size)
        # decided once: on a CPU builds or loads the compiled kernels (any notice now); no forward reads a setting
        model.kernels = dispatch.kernel_choice(self.pool.k)
        compiling = None if progress is None else (
            lambda done, total: progress(f"preparing {total} Triton kernel variants (compiled on a first start)", done, total))
        if warm_up(self.pool.layer(0), cfg.num_heads, self.dtype, self.max_context, self.exact_sink,  # GPU only
                   BATCH_BUCKETS, context_buckets(max_blocks), max_blocks, progress=compiling) == [] \
                and model.kernels.backend == "triton":
            model.kernels = dispatch.kernel_choice(self.pool.k)  # Triton could not build its launcher: the reference
        if model.kernels.fused is not None and self.device.type == "cuda":  # the decode step's fused kernels
            model.kernels.fused.warm_up(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, self.dtype,
                                        self.pool.layer(0), model.layers[0].self_attn.k_shift)
        # the compiled decoder layers where the model and pool fit them (their addresses are taken now)
        compiled = compiled_decode(model, self.pool) if model.kernels.backend == "compiled" else None
        self.plan: ExecutionPlan = plan_execution(
            self.device, model.kernels, self.pool.layer(0), weight_format=self.weight_format, compute_dtype=self.dtype,
            int8_kernel=self.int8_kernel, exact_sink=self.exact_sink, int8_prefill=self.int8_prefill,
            dense_kv=dense_kv, compiled_layers_fit=compiled is not None, cuda_graphs=settings.cuda_graphs())
        logging.getLogger(__name__).info("kvchat: engine plan: %s", self.plan.line())
        # chunks on the compiled layers store other bits than the torch layers': part of the fingerprint
        self.compiled_decode = compiled if self.plan.compiled_layers else None
        self.compute_key = compute_key(self.weight_format, dtype_name)  # the fingerprint's compute: None = implied
        self.identity = CacheIdentity(
            model_fingerprint, kv_dtype, self.spec.block_size, self.weight_format, self.compute_key, self.int8_kernel,
            self.plan.compiled_layers, self.calibration.digest if self.calibration else None, self.exact_sink,
            self.int8_prefill)
        self.scale_scheme, self.cache_fingerprint = self.identity.scale_scheme, self.identity.fingerprint
        self.blocks = BlockManager(self.pool.num_blocks, self.spec.block_size, bytes.fromhex(self.cache_fingerprint))
        self.dense = DenseKV(self.pool, self.blocks) if self.plan.dense_kv else None
        sink_shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) if self.exact_sink else None
        self.decode_buffers = DecodeBuffers(max_blocks, sink_shape, self.device)
        self.decode_graphs = DecodeGraphs(self.paged_decode_step) if self.plan.cuda_graphs else None  # None: eager
        self.load_ms = timer.stop()
        self.prefill_tokens_per_s = DEFAULT_PREFILL_TOKENS_PER_S

    def unquantized_layers(self) -> Iterator[Block]:
        """The decoder layers in order with their weights as loaded, before any quantization: what a calibration
        runs through (:func:`kvchat.engine.scratch.calibrate_k_mean`). The model's own layers, except while an
        int8 or int4 engine is loading, when each comes with its fp32 weights and is quantized once the caller
        moves on to the next (:meth:`kvchat.model.quantized_load.QuantizingLoad.unquantized_layers`)."""
        return self._unquantized if self._unquantized is not None else iter(self.model.layers)

    @property
    def decode_on_pool(self) -> bool:
        """Decode steps read the paged pool, not the dense copy (:attr:`ExecutionPlan.decode_on_pool`)."""
        return self.plan.decode_on_pool

    @property
    def pad_decode(self) -> bool:
        """Decode batches are padded to :data:`BATCH_BUCKETS` (:attr:`ExecutionPlan.pad_decode`)."""
        return self.plan.pad_decode

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

    def check_fits(self, num_tokens: int, what: str | None = None) -> None:
        """Raise :class:`~kvchat.context_fit.ContextFullError` if ``num_tokens`` exceeds :attr:`max_context`; its
        message is ``what`` (default ``conversation would be N tokens``) then :attr:`context_limit_text`."""
        check_fits(num_tokens, self.max_context,
                   lambda: f"{what or f'conversation would be {num_tokens} tokens'}; {self.context_limit_text}")

    @inference()  # called by hand too (benchmarks, tests); on the loop its mode is held already
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
        shared prefixes read identical numbers. Made once, never changed: the decode buffers copy a
        row's sink only when the row gets another one (:mod:`kvchat.engine.decode_buffers`).
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
                 sink: tuple[torch.Tensor, torch.Tensor] | None = None, capture_sink: bool = False,
                 dense_kv: DenseKV | None = None) -> torch.Tensor:
        """Write K/V for tokens ``[start, end)``; return their hidden states ``[end - start, hidden]``.

        ``register``: full blocks enter the prefix cache (see :meth:`BlockManager.commit`).
        ``sink``/``capture_sink``: used by :meth:`sink_kv` (which fills ``sink``
        layer by layer, on the paged path so the sequence's dense copy is kept).
        ``dense_kv``: the sequence's own dense copy (several running at once), else the engine's.
        """
        if sink is None and self.exact_sink:
            sink = self.sink_kv(token_ids[0])
        with device_guard(self.device):
            return self._forward_on_device(seq, token_ids, start, end, register, sink, capture_sink, dense_kv)

    def runs_compiled(self, start: int, end: int) -> bool:
        """Whether the chunk ``[start, end)`` runs on the compiled decoder layers (:attr:`compiled_decode`):
        up to :data:`COMPILED_LAYER_MAX_TOKENS` tokens after position 0, by its bounds alone, so a cold run
        and a resumed one compute it alike. It reads the pool, not the dense copy."""
        return self.compiled_decode is not None and 0 < start and end - start <= COMPILED_LAYER_MAX_TOKENS

    def _forward_on_device(self, seq, token_ids, start, end, register, sink, capture_sink, dense_kv) -> torch.Tensor:
        """:meth:`_forward`'s body, run with the engine's device current."""
        dev = self.device
        ids = torch.tensor(token_ids[start:end], dtype=torch.long, device=dev)
        if self.runs_compiled(start, end):  # never the sink's own forward: that is position 0
            self.prepare_write(seq, start, end)
            slots = torch.tensor(self.blocks.slots(seq, start, end), dtype=torch.long)
            table = torch.tensor([seq.block_table], dtype=torch.int32)
            hidden = self.compiled_decode.chunk(ids, start, slots, table,
                                                None if sink is None else (sink[0][None], sink[1][None]))
            self.blocks.commit(seq, token_ids, end, register)
            return hidden
        dense = None if capture_sink or self.dense is None else (dense_kv or self.dense)
        self.prepare_write(seq, start, end, dense, sink)
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

    def prefill_steps(self, seq: SeqBlocks, token_ids: Sequence[int], boundaries: Sequence[int] = (),
                      dense_kv: DenseKV | None = None):
        """Compute the tokens of ``token_ids`` not yet in the pool, as steps: yields a :class:`PrefillChunk`
        after each chunk (the engine loop runs other sequences' decode steps between them), returns the
        :class:`PrefillResult` (last-token logits, float32 ``[vocab_size]``).

        At least the last token is always computed (a full prefix hit still
        needs logits). Computing starts at the cold chunk plan's last edge at or
        below ``seq.num_computed`` (:func:`last_cut`), so the K/V are a cold
        run's bit for bit; pooled tokens after that edge are computed again and
        shared blocks from there on are copied on write.

        Args:
            seq: the sequence's blocks (``seq.num_computed`` tokens already in the pool).
            token_ids: the whole sequence, ids.
            boundaries: segment start offsets (tokens) for the chunk plan.
            dense_kv: the sequence's own dense copy (see :meth:`_forward`).
        Raises:
            ContextFullError: the sequence exceeds the context limit.
            PoolFullError: the pool cannot hold it.

        The caller holds ``torch.inference_mode`` (the engine loop's thread does). ``prefill_ms`` counts this
        sequence's chunks only, not what the caller runs between them (other requests' decode steps), so it
        and :attr:`prefill_tokens_per_s` are this prefill's own.
        """
        self.check_fits(len(token_ids))
        # from a cold chunk edge (the last token is always computed, for logits): every chunk is one a cold
        # run computes, so the K/V are bit-identical to a cold run's however the earlier ones were obtained
        start = prefill_start(seq.num_computed, len(token_ids), boundaries)
        seq.num_computed = start
        timer, ms = DeviceTimer(self.device), 0.0
        hidden = None
        for a, b in chunk_plan(start, len(token_ids), boundaries):
            timer.start()
            hidden = self._forward(seq, token_ids, a, b, dense_kv=dense_kv)
            ms += timer.stop()
            yield PrefillChunk(b - start, len(token_ids) - start, b - a)
        timer.start()
        logits = self.model.logits(hidden[-1:])[0]
        ms += timer.stop()
        if len(token_ids) - start >= 64:
            self.prefill_tokens_per_s = (len(token_ids) - start) / (ms / 1e3)
        return PrefillResult(logits, len(token_ids) - start, ms)

    @inference()  # called by hand too (benchmarks, tests); on the loop its mode is held already
    def score(self, seq: SeqBlocks, token_ids: Sequence[int], boundaries: Sequence[int] = ()) -> torch.Tensor:
        """Teacher-forced logits for every position not yet in the pool.

        Same chunk plan and pool path as :meth:`prefill_steps`; each chunk attends
        through the pool, so every position sees K/V as stored (quantized).

        Returns:
            float32 ``[len(token_ids) - seq.num_computed, vocab_size]``; row i
            predicts token ``seq.num_computed + i + 1``.
        """
        self.check_fits(len(token_ids))
        start = seq.num_computed
        rows = [self.model.logits(self._forward(seq, token_ids, a, b)) for a, b in chunk_plan(start, len(token_ids), boundaries)]
        return torch.cat(rows)

    @inference()  # called by hand too (benchmarks, tests); on the loop its mode is held already
    def decode(self, seq: SeqBlocks, token_ids: Sequence[int], dense_kv: DenseKV | None = None) -> torch.Tensor:
        """Run the last id of ``token_ids`` (all earlier ones in the pool); float32 logits ``[vocab_size]``.

        Decode's K/V are provisional: one token at a time they differ in the
        last bits from what a prefill chunk computes, so their blocks stay out
        of the prefix cache and the turn (:meth:`kvchat.engine.session.Session.turn`) recomputes
        the answer as prefill chunks once it ends (see :func:`last_cut`). ``dense_kv``: the sequence's own
        dense copy when decode reads one (not :attr:`decode_on_pool`), else unused.
        """
        dense = None if self.decode_on_pool else [dense_kv or self.dense]
        return self._decode_rows([(seq, token_ids)], dense)[0]

    @inference()  # called by hand too (benchmarks, tests); on the loop its mode is held already
    def decode_batch(self, steps: Sequence[DecodeStep]) -> torch.Tensor:
        """One decode forward for several sequences: float32 logits ``[len(steps), vocab_size]``.

        The linear layers run once over the ``num_seqs`` new tokens; attention
        reads each sequence's own K/V: the paged kernels with a ``[num_seqs, max_blocks]`` block table
        (:attr:`decode_on_pool`: GPUs, and CPUs with the compiled kernels), else each sequence's dense copy.
        One step alone is exactly :meth:`decode`.

        Raises:
            ContextFullError: a sequence exceeds the context limit.
            PoolFullError: a sequence cannot get a slot; ``exc.index`` is its place in ``steps``
                (the others are unchanged but for a reserved slot).
            ValueError: decoding over dense copies (not :attr:`decode_on_pool`), two steps share one (or lack one).

        More steps than the largest batch bucket (:data:`kvchat.engine.decode_buffers.BATCH_BUCKETS`) run
        as one forward per group of that many.
        """
        denses = None
        if not self.decode_on_pool:
            denses = [s.sequence.dense for s in steps]
            if len(steps) == 1:
                denses = [denses[0] or self.dense]
            elif None in denses or len({id(d) for d in denses}) < len(denses):
                raise ValueError("a batched decode on the CPU read path needs one dense copy per sequence")
        top, out = BATCH_BUCKETS[-1], []
        for g in range(0, len(steps), top):  # the buffers hold the largest bucket: one forward per group of it
            part = steps[g : g + top]
            try:
                out.append(self._decode_rows([(s.sequence.blocks, s.token_ids) for s in part],
                                             None if denses is None else denses[g : g + top]))
            except PoolFullError as exc:  # earlier groups have run: sent again, they recompute the same K/V
                exc.index += g
                raise
        return out[0] if len(out) == 1 else torch.cat(out)

    def _decode_rows(self, items: Sequence[tuple[SeqBlocks, Sequence[int]]],
                     denses: list[DenseKV] | None) -> torch.Tensor:
        """:meth:`decode_batch`'s body over ``(blocks, token_ids)`` pairs through the persistent decode
        buffers (:mod:`kvchat.engine.decode_buffers`); ``denses``: one dense copy per row on the CPU read path."""
        rows = batch_bucket(len(items), padded=self.pad_decode)
        sinks = [self.sink_kv(ids[0]) if self.exact_sink else None for _, ids in items]
        for i, (seq, ids) in enumerate(items):
            n = len(ids)
            self.check_fits(n)
            try:
                self.prepare_write(seq, n - 1, n, denses[i] if denses else None, sinks[i])
            except PoolFullError as exc:
                exc.index = i
                raise
        step = [DecodeRow(seq, ids[-1], len(ids) - 1, self.blocks.slots(seq, len(ids) - 1, len(ids))[0],
                          None if denses else sink) for (seq, ids), sink in zip(items, sinks)]
        width = context_bucket(max(len(seq.block_table) for seq, _ in items), self.decode_buffers.max_blocks)
        with device_guard(self.device):
            view = self.decode_buffers.load(step, rows, width)
            if denses is None:
                logits = (self.decode_graphs or self.paged_decode_step)(rows, width)[: len(items)]
            else:
                one = len(items) == 1
                meta = AttnMetadata(view.slot_mapping, view.block_table, view.seq_lens, view.cu_seqlens_q, True,
                                    dense=denses[0] if one else None, q_start=step[0].position,
                                    dense_batch=None if one else [(d, r.position) for d, r in zip(denses, step)])
                logits = self.model.logits(self.model(view.input_ids, view.positions, meta, self.pool))
        for i, (seq, ids) in enumerate(items):
            if denses is not None:
                denses[i].finish(seq, len(ids))
            self.blocks.commit(seq, ids, len(ids), register=False)
        return logits

    def paged_decode_step(self, rows: int, width: int) -> torch.Tensor:
        """The decode forward over the decode buffers' current views, ``rows`` rows and ``width`` block-table
        columns, through the paged kernels: float32 logits ``[rows, vocab_size]``. What a CUDA graph
        captures (:mod:`kvchat.engine.decode_graphs`): device work only, no host read. On a CPU with
        :attr:`compiled_decode` the compiled layers run instead (they read the lengths and slots on the host
        to check them)."""
        view = self.decode_buffers.view(rows, width, with_sink=self.exact_sink)
        if self.compiled_decode is not None:
            return self.compiled_decode(view.input_ids, view.positions, view.slot_mapping, view.block_table,
                                        view.seq_lens, view.sink)
        meta = AttnMetadata(view.slot_mapping, view.block_table, view.seq_lens, view.cu_seqlens_q, True, sink=view.sink,
                            provisional=True)
        return self.model.logits(self.model(view.input_ids, view.positions, meta, self.pool))

    def release(self, seq: SeqBlocks) -> None:
        """Free a sequence's blocks (they stay in the prefix cache until reused)."""
        self.blocks.free_seq(seq)
