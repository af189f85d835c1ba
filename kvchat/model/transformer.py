"""Llama-family decoder (llama, mistral, qwen2, qwen3) reading K/V only through the paged pool.

Plain modules in the spirit of gpt-fast. Every forward writes the new
tokens' K/V into the pool first (``write_kv``) and then attends through the
pool (``extend_attention`` for chunks, ``decode_attention`` for one token per
sequence, or on CPU a contiguous copy read back from the pool, ``dense_kv``),
so prefill, extend and decode all read the same stored values.
Architecture: Touvron et al. 2023 (Llama 2: RMSNorm, RoPE, SwiGLU, GQA);
llama3 RoPE scaling as in Meta's Llama 3.1 reference code; Qwen2 adds a bias
to q/k/v; Qwen3 RMS-normalises q and k per head before RoPE.

A decode step on the Triton backend runs :mod:`kvchat.kernels.triton_fused` in place of the
elementwise operators (the residual add with each RMSNorm, RoPE with the K shift and the cache write,
SiLU·mul), so a decoder layer runs in 10 launches (``kvchat.bench.launch_count``); the residual stream
is carried between layers as ``(x, delta)`` so that each add fuses into the norm that follows it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kvchat.kernels import dispatch
from kvchat.model.config import ModelConfig

if TYPE_CHECKING:  # the engine owns the pool and the dense copy and hands them in: the model never builds one
    from kvchat.engine.dense_kv import DenseKV
    from kvchat.engine.kv_pool import KVPool


@dataclass(slots=True)
class AttnMetadata:
    """Where the tokens of one forward pass go in the pool and what they see.

    Attributes:
        slot_mapping: int64 ``[num_tokens]`` pool slot of each new token (-1 = skip).
        block_table: int32 ``[num_seqs, max_blocks]``.
        seq_lens: int32 ``[num_seqs]`` tokens in the pool per sequence, new ones included.
        cu_seqlens_q: int32 ``[num_seqs + 1]`` offsets of each sequence's new tokens.
        is_decode: exactly one new token per sequence (selects the decode kernel).
        dense: the sequence's contiguous dequantized K/V copy (CPU read path,
            one sequence only); when set, attention reads it instead of the block table.
        q_start: position of the first new token (used with ``dense``).
        sink: exact position-0 K/V of the (one) sequence, float32 ``[num_layers,
            num_kv_heads, head_dim]`` x2, read by attention instead of the stored
            position 0 (see :meth:`kvchat.engine.runner.Engine.sink_kv`); None: read the pool.
        capture_sink: fill ``sink`` from this forward's token 0 (a one-token
            forward at position 0), layer by layer before attention reads it.
            A batched decode passes ``sink`` as ``[num_seqs, num_layers, num_kv_heads, head_dim]`` x2.
        dense_batch: a batched decode on the CPU read path: per sequence (its own
            dense copy, position of its new token); attention runs per sequence.
        provisional: a decode step (:meth:`kvchat.engine.runner.Engine.decode`), whose K/V are recomputed
            as prefill chunks later: a CPU pool may take the compiled decode attention
            (:func:`kvchat.kernels.dispatch.decode_attention`), whose rounding never reaches stored K/V.
    """

    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    is_decode: bool
    dense: DenseKV | None = None
    q_start: int = 0
    sink: tuple[torch.Tensor, torch.Tensor] | None = None
    capture_sink: bool = False
    dense_batch: list[tuple[DenseKV, int]] | None = None
    provisional: bool = False


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` float32 on the CPU, with llama3/linear scaling if configured.

    Raises:
        ValueError: an unsupported ``rope_scaling`` type.
    """
    dim = cfg.head_dim
    # on the CPU whatever the default device: under build_model's meta device, meta ops would pull in
    # ~900 modules (~150 MB) of torch's meta machinery for a 64-float vector
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv.float()
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return (inv / scaling["factor"]).float()
    if kind != "llama3":
        raise ValueError(f"rope scaling {kind!r} is not supported")
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    smooth = (old_ctx / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
    return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (Su et al. 2021, HF layout) in three ops.

    ``x`` ``[T, heads, D]``; ``cos`` and ``sin_signed`` ``[T, 1, D]`` from
    :meth:`Transformer.rope`, where ``sin_signed`` carries rotate-half's minus
    sign on its first half, so ``rotate_half(x) * sin == swap_halves(x) * sin_signed``.
    """
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, sin_signed)


class Linear(nn.Module):
    """``y = x W^T (+ b)`` with uninitialised parameters (weights are always loaded;
    skipping ``nn.init`` keeps model construction instant)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features  # known with a shared (tied) weight too
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), computed in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op; same formula (no cast to round through)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor | None,
                    fused: ModuleType | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + delta), x + delta)``, or ``(norm(x), x)`` when ``delta`` is None (the residual add a
        pre-norm layer makes before its norm). ``fused``: :mod:`kvchat.kernels.triton_fused`, both in one
        launch (rounded as here, see its module doc)."""
        if fused is not None:
            return fused.add_rms_norm(x, delta, self.weight, self.eps)
        if delta is not None:
            x = x + delta
        return self(x), x


class Attention(nn.Module):
    """GQA self-attention over the paged pool; q/k/v fused into one projection.

    ``k_shift`` (``[num_kv_heads, head_dim]``, set by the engine for fp8 pools
    from :mod:`kvchat.engine.calibration`) is subtracted from post-RoPE K before
    it is stored: every score of a query moves by the same amount, which
    softmax ignores, and the stored values get smaller rounding errors.
    """

    k_shift: torch.Tensor | None = None

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.cfg, self.layer_id = cfg, layer_id
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.sm_scale = cfg.head_dim**-0.5

    def forward(self, x, cos, sin, meta: AttnMetadata, pool: KVPool, backend: str | None = None,
                fused: ModuleType | None = None) -> torch.Tensor:
        """``x`` ``[T, hidden]`` -> ``[T, hidden]``, the new tokens' K/V written into ``pool`` first.

        ``backend``: the attention backend decided at load (:class:`kvchat.kernels.dispatch.KernelChoice`;
        None: decided per call). ``fused``: :mod:`kvchat.kernels.triton_fused` in a decode step on the
        Triton backend: RoPE, the K shift and the cache write in one launch.
        """
        t, heads = x.shape[0], self.cfg.num_heads
        qkv = self.qkv(x)
        qk = qkv[:, : self.q_size + self.kv_size].view(t, -1, self.cfg.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.cfg.num_kv_heads, self.cfg.head_dim)
        if self.cfg.qk_norm:
            qk = torch.cat((self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])), dim=1)
        kv = pool.layer(self.layer_id)
        if fused is not None:  # never a sink's capture: that is a forward at position 0, not a decode step
            q = fused.rope_write_kv(qk, v, cos, sin, self.k_shift, kv, meta.slot_mapping)
        else:
            qk = apply_rope(qk, cos, sin)  # q and k heads rotated together
            q, k = qk[:, :heads], qk[:, heads:]
            if self.k_shift is not None:
                k = k - self.k_shift
            if meta.capture_sink:
                meta.sink[0][self.layer_id], meta.sink[1][self.layer_id] = k[0], v[0]
            dispatch.write_kv(k, v, kv, meta.slot_mapping, backend)
        if meta.dense is not None:  # the dense copy holds the sink in row 0 already
            key, value = meta.dense.append(self.layer_id, meta.slot_mapping, meta.q_start)
            out = dispatch.dense_attention(q, key, value, meta.q_start, self.sm_scale)
            return self.o_proj(out.reshape(t, self.q_size))
        if meta.dense_batch is not None:  # one new token per sequence, each over its own dense copy
            k_new = dispatch.read_slots(kv.k_cache, kv.k_scale, meta.slot_mapping)  # every sequence's token in one read
            v_new = dispatch.read_slots(kv.v_cache, kv.v_scale, meta.slot_mapping)
            outs = [dispatch.dense_attention(q[i : i + 1], *dense.put(self.layer_id, pos, k_new[i : i + 1], v_new[i : i + 1]),
                                            pos, self.sm_scale)
                    for i, (dense, pos) in enumerate(meta.dense_batch)]
            return self.o_proj(torch.cat(outs).reshape(t, self.q_size))
        sink = None
        if meta.sink is not None:  # [num_layers, ...] for one sequence, [num_seqs, num_layers, ...] batched
            sink = tuple(x.reshape(-1, *x.shape[-3:])[:, self.layer_id] for x in meta.sink)
        if meta.is_decode:
            out = dispatch.decode_attention(q, kv, meta.block_table, meta.seq_lens, self.sm_scale, sink, meta.provisional,
                                            backend)
        else:
            out = dispatch.extend_attention(q, kv, meta.block_table, meta.seq_lens, meta.cu_seqlens_q, self.sm_scale,
                                            sink, backend)
        return self.o_proj(out.reshape(t, self.q_size))


class MLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020) with gate and up fused."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, fused: ModuleType | None = None) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]``; ``fused``: :mod:`kvchat.kernels.triton_fused`'s SiLU·mul (one launch)."""
        gate_up = self.gate_up(x)
        if fused is not None:
            return self.down_proj(fused.silu_mul(gate_up))
        gate, up = gate_up.split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm decoder layer over the residual stream ``x + delta`` (see :meth:`forward`)."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, delta, cos, sin, meta: AttnMetadata, pool: KVPool, backend: str | None = None,
                fused: ModuleType | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on hidden states ``x + delta`` (``delta`` None: ``x``), ``[T, hidden]`` each; returns the
        next ``(x, delta)``: the layer's output is their sum, which the next norm computes
        (:meth:`RMSNorm.add_forward`: with ``fused``, in its own launch). ``backend``, ``fused``: see
        :meth:`Attention.forward`."""
        h, x = self.input_layernorm.add_forward(x, delta, fused)
        h, x = self.post_attention_layernorm.add_forward(x, self.self_attn(h, cos, sin, meta, pool, backend, fused), fused)
        return x, self.mlp(h, fused)


class Transformer(nn.Module):
    """The whole decoder. ``forward`` returns last-layer hidden states; ``logits`` projects them.

    ``kernels``: what the forwards run, decided once by the engine that loads the model
    (:func:`kvchat.kernels.dispatch.kernel_choice`); None (a bare model): each call decides.
    """

    kernels: dispatch.KernelChoice | None = None

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin_signed)`` ``[T, 1, head_dim]`` for int64 ``positions`` ``[T]`` (angles in fp32);
        see :func:`apply_rope` for the sign."""
        angles = positions.float().unsqueeze(-1) * self.inv_freq
        sin = angles.sin()
        cos = torch.cat((angles, angles), dim=-1).cos().unsqueeze(1)
        return cos.to(dtype), torch.cat((-sin, sin), dim=-1).unsqueeze(1).to(dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata, pool: KVPool) -> torch.Tensor:
        """Run ``input_ids`` int64 ``[T]`` at ``positions`` ``[T]``; returns hidden ``[T, hidden_size]``.

        Writes each layer's new K/V into ``pool`` at ``meta.slot_mapping``. A decode step
        (``meta.provisional``) runs :attr:`kernels`' fused kernels where there are any.
        """
        x = F.embedding(input_ids, self.embed_tokens)
        cos, sin = self.rope(positions, x.dtype)
        backend = fused = delta = None
        if self.kernels is not None:
            backend = self.kernels.backend
            fused = self.kernels.fused if meta.provisional else None
        for layer in self.layers:
            x, delta = layer(x, delta, cos, sin, meta, pool, backend, fused)
        return self.norm.add_forward(x, delta, fused)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[T, hidden_size]`` -> float32 logits ``[T, vocab_size]``.

        A batched decode's few rows (2..8) on CPU go through ``W @ hidden^T``: for SmolLM2's 49152x576 head
        (the largest matmul of a decode step) measured 9.6 vs 36 ms at 2 rows, 12 vs 25 ms at 4, against
        ``F.linear`` (1 thread, this 2-core AVX2 machine); one row and prefill chunks keep ``F.linear``.
        """
        head = self.lm_head
        if 1 < hidden.shape[0] <= 8 and hidden.device.type == "cpu" and type(head) is Linear and head.bias is None:
            return (head.weight @ hidden.T).T.float()
        return head(hidden).float()

    def load_hf_state_dict(self, sd) -> None:
        """Fill every parameter from Hugging Face-named weights, fusing q/k/v and gate/up (:func:`hf_sources`).

        ``sd``: a ``{name: tensor}`` mapping or a :mod:`kvchat.model.weights` reader
        (tensors streamed one at a time into the parameters, each part of a fused
        parameter into its row slice). A tied model's ``lm_head`` shares the
        embedding's storage.

        Raises:
            KeyError: a tensor the config requires is missing.
        """
        from kvchat.model.weights import weight_reader

        src = weight_reader(sd)
        sources = hf_sources(self.cfg, has_lm_head(self.cfg, src))
        with torch.no_grad():
            for param, names in sources.items():
                fill_rows(src, self.get_parameter(param), names)
            if "lm_head.weight" not in sources:
                self.lm_head.weight = self.embed_tokens


def has_lm_head(cfg: ModelConfig, src) -> bool:
    """Whether the model reads an ``lm_head.weight`` of its own from ``src`` (a reader or mapping); else its head
    shares the embedding (tied, or a checkpoint that stores no head)."""
    return "lm_head.weight" in src and not cfg.tie_word_embeddings


def hf_sources(cfg: ModelConfig, lm_head: bool) -> dict[str, tuple[str, ...]]:
    """Every parameter of a :class:`Transformer` of ``cfg`` (its ``get_parameter`` name) -> the Hugging Face
    tensors whose rows it holds, in order (q/k/v and gate/up fused), in reading order: the embedding, the head
    (``lm_head``: it has its own, :func:`has_lm_head`), the final norm, then layer by layer."""
    out = {"embed_tokens": ("model.embed_tokens.weight",)}
    if lm_head:
        out["lm_head.weight"] = ("lm_head.weight",)
    out["norm.weight"] = ("model.norm.weight",)
    for i in range(cfg.num_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        out[q + "self_attn.qkv.weight"] = tuple(p + f"self_attn.{n}_proj.weight" for n in "qkv")
        if cfg.attention_bias:
            out[q + "self_attn.qkv.bias"] = tuple(p + f"self_attn.{n}_proj.bias" for n in "qkv")
        out[q + "self_attn.o_proj.weight"] = (p + "self_attn.o_proj.weight",)
        if cfg.qk_norm:
            out[q + "self_attn.q_norm.weight"] = (p + "self_attn.q_norm.weight",)
            out[q + "self_attn.k_norm.weight"] = (p + "self_attn.k_norm.weight",)
        out[q + "mlp.gate_up.weight"] = (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
        out[q + "mlp.down_proj.weight"] = (p + "mlp.down_proj.weight",)
        out[q + "input_layernorm.weight"] = (p + "input_layernorm.weight",)
        out[q + "post_attention_layernorm.weight"] = (p + "post_attention_layernorm.weight",)
    return out


def fill_rows(src, param: torch.Tensor, names: tuple[str, ...]) -> None:
    """Read the tensors ``names`` of ``src`` (a :mod:`kvchat.model.weights` reader) into consecutive row slices of
    ``param`` (one tensor fills it whole). Raises KeyError for a missing name."""
    row = 0
    for name in names:
        rows = src.shape(name)[0]
        src.read_into(name, param[row : row + rows])
        row += rows


def build_model(cfg: ModelConfig, weights, device: torch.device, dtype: torch.dtype) -> Transformer:
    """A :class:`Transformer` in ``dtype`` on ``device`` with ``weights`` loaded, never materialised in fp32.

    Built on the ``meta`` device (no memory), given uninitialised storage in
    ``dtype`` on ``device`` (the weights' bytes in ``dtype``, nothing more),
    then filled tensor by tensor (:meth:`Transformer.load_hf_state_dict`), so
    peak memory is the weights in ``dtype`` plus one tensor in flight. RoPE's
    ``inv_freq`` stays float32.

    Args:
        weights: a ``{name: tensor}`` mapping or a :mod:`kvchat.model.weights` reader.
    """
    from kvchat.model.weights import weight_reader

    src = weight_reader(weights)
    with torch.device("meta"):
        model = Transformer(cfg)
    if not has_lm_head(cfg, src):
        model.lm_head.weight = None  # shares the embedding (load_hf_state_dict): no storage of its own
    model = model.to(dtype).to_empty(device=device)
    model.load_hf_state_dict(src)
    model.inv_freq = rope_inv_freq(cfg).to(device)
    return model.eval()
