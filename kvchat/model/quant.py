"""Weight-only quantized linear layers for the CPU (int8, int4), quantized once per model and stored beside it.

int8 has two schemes, chosen by whether the compiled kernel runs here
(:func:`kvchat.kernels.cpu_int8.small_rows_kernel`); each has its own name in
the cache fingerprint (:func:`kvchat.model.int8_scheme.int8_compute_scheme`); int4 (``--weights int4``) one,
named by :func:`kvchat.model.int4_scheme.int4_compute_scheme`.
Only the linear layers are quantized (q/k/v, o, gate/up, down and the LM
head); embeddings, norms, RoPE, attention, softmax and logits stay fp32.

**Groups of 32, asymmetric** (``INT8_GROUPS_SCHEME``, :class:`Int8GroupLinear`;
where the compiled kernel builds): per output channel and 32 inputs,
``scale = (max - min) / 255``, ``offset = min + 128 * scale``,
``q = round((w - offset) / scale)`` in ``[-128, 127]``, so the group's
extremes are grid points (min-max affine quantization as in Jacob et al.
2018, per group as in GGUF's Q4_1/Q8_1 blocks). Measured on SmolLM2 (fp8
pool, 2,047 teacher-forced positions, weights quantized and dequantized,
against the imported weights): seed article 002 +0.10% perplexity, 004
-0.20% (KL 0.0029 / 0.0041), against +1.04% / +0.94% (KL 0.0077 / 0.0098)
per channel and +0.08% / +0.46% for symmetric groups of 32 (the imported
weights are dequantized Q4_1 blocks of 32: 16 levels from min to max, which
an affine grid over the same 32 inputs holds within 1/34 of a level).
Kernels by the number of input rows ``M`` alone (a cold run and a resumed
run cut the same chunks, so they compute the same numbers):
``M <= GROUPS_KERNEL_MAX_ROWS`` (decode, a question after a resume) the
compiled kernel, fp32 activations as they are; larger ``M`` (512-token
prefill chunks) the weight dequantized to fp32 into a reused scratch buffer
and an fp32 GEMM.

**Per output channel, symmetric** (``INT8_SCHEME``, :class:`Int8Linear`;
where it does not): ``scale = max(|w|) / 127``, ``q = round(w / scale)`` in
``[-127, 127]`` (the weight-only absmax scheme of Dettmers et al. 2022,
LLM.int8(), without its outlier split), the layout
``torch._weight_int8pack_mm`` takes, except in ``down_proj``
(``GROUP_SIZES``: groups of 256 inputs, one kernel call per group summed in
fp32; its 1,536 inputs carry the outliers: +0.76% perplexity per channel
everywhere, bf16 pool, +0.12% with these groups, on article 000). Up to
``INT8MM_MAX_ROWS`` rows ``torch._weight_int8pack_mm`` with the activations
cast to bf16 at its input (its CPU kernel is vectorized for bf16 activations
only; with fp32 ones it falls back to scalar code, ~15x slower), unit
scales, the accumulated row then multiplied by the fp32 scales (a bf16 copy
of the scales would bias every channel by up to 0.4%); larger ``M`` the
dequantized fp32 GEMM (measured here, 2 threads, the 120 layer matmuls of
SmolLM2: int8mm 2.7 s, dequantize + fp32 2.1 s, fp32 weights 1.8 s at
``M = 512``; at ``M = 128`` 0.67 / 0.98 / 1.10 s; at ``M = 15`` 0.11 /
0.20 / 0.15 s).

**int4, groups of 32, asymmetric** (``INT4_SCHEME``, :class:`Int4GroupLinear`; only where the compiled kernel
:mod:`kvchat.kernels.cpu_int4` builds): per output channel and 32 inputs an fp16 ``scale = (max - min) / 15``
and an fp16 ``minimum = min``, ``q = round((w - minimum) / scale)`` in ``[0, 15]``, two per byte: GGUF's Q4_1
block (20 bytes per 32 weights, 0.625 bytes per parameter against int8 groups' 1.25); the LM head stays int8
groups (:func:`layer_kind` says why). Every row count quantizes the activations to int8 per group of 32 and
multiplies on integer dot products (:mod:`kvchat.kernels.cpu_int4`, llama.cpp's Q4_1 x Q8_1 dot product): up to
``GROUPS_KERNEL_MAX_ROWS`` rows (decode) its group kernel, more rows (512-token prefill chunks) its channel-lanes
kernel, the same formula in another float order with 16 output channels per register, 3.1x the group kernel at
512 rows; the compiled decoder layers run chunks of ``INT4_LANE_MIN_TOKENS`` tokens or more (a question after a
resume) on the channel-lanes kernel too (docs/performance.md, "4-bit weights", where the cost in perplexity is
measured too).

The tensors live in ``models_dir()/.weights/<model fingerprint>.<scheme>.safetensors``
(:func:`quantized_path`; written atomically on first use, read on every later load). A model is loaded with
them layer by layer, never whole in fp32: :mod:`kvchat.model.quantized_load`.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kvchat.kernels import cpu_int4, cpu_int8, cpu_int8_int8
from kvchat.model.int4_scheme import INT4_SCHEME
from kvchat.model.int8_scheme import GROUP_SIZES, GROUPS_KERNEL_MAX_ROWS, INT8MM_MAX_ROWS, stored_scheme
from kvchat.paths import models_dir

WEIGHTS_DIR = ".weights"
QMAX = 127
INT4_LEVELS = 15  # the largest 4-bit value: a group spans 0..15 steps of its scale

_scratch = threading.local()  # one fp32 buffer per thread for the dequantized weight of the large-M path


def quantized_path(model_fingerprint: str, scheme: str) -> Path:
    """Where a model's quantized weights in ``scheme`` (:func:`kvchat.model.int8_scheme.stored_scheme`,
    :data:`kvchat.model.int4_scheme.INT4_SCHEME`) live: the
    models dir, beside its calibration; one file per scheme, so two processes of another kernel choice
    sharing the models dir do not rewrite each other's."""
    return models_dir() / WEIGHTS_DIR / f"{model_fingerprint}.{scheme}.safetensors"


def group_size(name: str, in_features: int) -> int:
    """Input columns per scale of the layer called ``name`` (:data:`GROUP_SIZES`; the whole row otherwise,
    or when the row does not split evenly)."""
    size = next((v for k, v in GROUP_SIZES.items() if name.endswith(k)), in_features)
    return size if in_features % size == 0 else in_features


def quantize_int8(weight: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[out, in]`` (any float dtype) -> ``(q int8 [G, out, group], scale float32 [G, out])``
    with ``G = in // group`` (``group`` None: the whole row, ``G = 1``) and
    ``w[:, g*group:(g+1)*group] ≈ q[g] * scale[g][:, None]``. An all-zero group gets scale 1 (its ``q`` is 0).
    """
    out_features, in_features = weight.shape
    group = group or in_features
    w = weight.detach().float().view(out_features, in_features // group, group).transpose(0, 1)
    amax = w.abs().amax(dim=2)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = torch.round(w / scale[..., None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q.contiguous(), scale.contiguous()


class _Int8Layer(nn.Module):
    """What both int8 layers share: ``y = x W^T (+ b)`` for float32 ``x`` ``[..., in_features]``, the few-row
    kernel up to :attr:`max_rows` rows (:meth:`_few_rows`), else an fp32 GEMM over :meth:`_dequantized`."""

    max_rows: int

    def __init__(self, out_features: int, in_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` float32 ``[..., in_features]`` -> float32 ``[..., out_features]``."""
        rows = x.reshape(-1, self.in_features)
        y = self._few_rows(rows) if rows.shape[0] <= self.max_rows else self._many_rows(rows)
        if self.bias is not None:
            y.add_(self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def _few_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """float32 ``[M, in_features]`` -> ``[M, out_features]`` on the layer's int8 kernel (no bias)."""
        raise NotImplementedError

    def _many_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """float32 ``[M, in_features]`` -> ``[M, out_features]`` past :attr:`max_rows` (no bias): the fp32 GEMM."""
        return F.linear(rows, self._dequantized())

    def _dequantized(self) -> torch.Tensor:
        """The fp32 weight ``[out, in]`` in this thread's scratch buffer (valid until the next call)."""
        raise NotImplementedError


class Int8Linear(_Int8Layer):
    """``y = x W^T (+ b)`` with ``W`` held as int8 groups and fp32 scales (the module doc's per-channel scheme).

    Attributes:
        q: int8 ``[G, out_features, in_features // G]`` (each ``q[g]`` contiguous, as the kernels take it).
        scale: float32 ``[G, out_features]``.
        bias: float32 ``[out_features]`` or None.
    """

    max_rows = INT8MM_MAX_ROWS

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
        groups, out_features, group = q.shape
        super().__init__(out_features, groups * group, bias)
        self.groups, self.group = groups, group
        self.register_buffer("q", q)
        self.register_buffer("scale", scale.float())
        self.register_buffer("unit", torch.ones(self.out_features, dtype=torch.bfloat16, device=q.device),
                             persistent=False)

    @property
    def weight_bytes(self) -> int:
        """Bytes a matmul reads for the weight (int8 values + fp32 scales)."""
        return self.q.numel() + self.scale.numel() * 4

    def _few_rows(self, rows: torch.Tensor) -> torch.Tensor:
        xb = rows.to(torch.bfloat16, memory_format=torch.contiguous_format)  # the kernel reads rows densely
        if self.groups == 1:
            return torch._weight_int8pack_mm(xb, self.q[0], self.unit).float().mul_(self.scale[0])
        xg = xb.view(-1, self.groups, self.group).transpose(0, 1).contiguous()
        y = torch._weight_int8pack_mm(xg[0], self.q[0], self.unit).float().mul_(self.scale[0])
        for g in range(1, self.groups):
            y.add_(torch._weight_int8pack_mm(xg[g], self.q[g], self.unit).float().mul_(self.scale[g]))
        return y

    def _dequantized(self) -> torch.Tensor:
        w = _scratch_buffer(self.q.numel(), self.q.device).view(self.out_features, self.groups, self.group)
        w.copy_(self.q.transpose(0, 1)).mul_(self.scale.t()[..., None])
        return w.view(self.out_features, self.in_features)


def _scratch_buffer(n: int, device: torch.device) -> torch.Tensor:
    """This thread's fp32 scratch of at least ``n`` values (the dequantized weight of the large-M path)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < n or buf.device != device:
        with torch.inference_mode(False):  # a normal tensor: written in and out of inference mode alike
            buf = _scratch.buf = torch.empty(n, device=device)
    return buf[:n]


def quantize_int8_groups(weight: torch.Tensor, group: int = cpu_int8.GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` ``[out, in]`` (any float dtype, ``in`` a multiple of ``group``) -> ``(q int8 [out, in],
    scale float32 [out, in // group], offset float32 [out, in // group])`` with
    ``w[n, g*group + k] ≈ scale[n, g] * q[n, g*group + k] + offset[n, g]`` (the module doc's affine scheme).
    A constant group gets scale 1 and its value as offset (``q`` 0: exact).

    Raises:
        ValueError: ``in`` is not a multiple of ``group``.
    """
    out_features, in_features = weight.shape
    if in_features % group:
        raise ValueError(f"{in_features} inputs do not split into groups of {group}")
    w = weight.detach().float().view(out_features, in_features // group, group)
    lo, hi = w.amin(dim=2), w.amax(dim=2)
    scale = torch.where(hi > lo, (hi - lo) / 255, torch.ones_like(lo))
    offset = torch.where(hi > lo, lo + 128 * scale, lo)
    q = torch.round((w - offset[..., None]) / scale[..., None]).clamp_(-128, 127).to(torch.int8)
    return q.view(out_features, in_features).contiguous(), scale.contiguous(), offset.contiguous()


class Int8GroupLinear(_Int8Layer):
    """``y = x W^T (+ b)`` with ``W`` as int8 values and an fp32 scale and offset per 32 inputs of each
    output channel (the module doc's groups scheme; the compiled kernel for few rows).

    Attributes:
        q: int8 ``[out_features, in_features]``.
        scale, offset: float32 ``[out_features, in_features // 32]``.
        bias: float32 ``[out_features]`` or None.
    """

    max_rows = GROUPS_KERNEL_MAX_ROWS

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(*q.shape, bias)
        self.groups = scale.shape[1]
        # past max_rows, int8 activations on the integer kernel instead of the fp32 GEMM: set by the engine's
        # plan (kvchat.engine.execution_plan.ExecutionPlan.int8_prefill), never per call
        self.integer_prefill = False
        self.register_buffer("q", q)
        self.register_buffer("scale", scale.float())
        self.register_buffer("offset", offset.float())

    @property
    def weight_bytes(self) -> int:
        """Bytes a matmul reads for the weight (int8 values + fp32 scales and offsets)."""
        return self.q.numel() + (self.scale.numel() + self.offset.numel()) * 4

    def _few_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return cpu_int8.int8_matmul(rows, self.q, self.scale, self.offset)

    def _many_rows(self, rows: torch.Tensor) -> torch.Tensor:
        if self.integer_prefill:
            return cpu_int8_int8.int8_int8_matmul(rows, self.q, self.scale, self.offset)
        return super()._many_rows(rows)

    def _dequantized(self) -> torch.Tensor:
        w = _scratch_buffer(self.q.numel(), self.q.device).view(self.out_features, self.groups, -1)
        w.copy_(self.q.view(self.out_features, self.groups, -1)).mul_(self.scale[..., None]).add_(self.offset[..., None])
        return w.view(self.out_features, self.in_features)


def quantize_int4_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` ``[out, in]`` (any float dtype, ``in`` a multiple of 32) -> ``(packed uint8 [out, in // 2],
    scale float16 [out, in // 32], minimum float16 [out, in // 32])``, the module doc's int4 scheme:
    ``w[n, 32 g + k] ≈ scale[n, g] * q[n, 32 g + k] + minimum[n, g]`` with ``q`` in 0..15 packed by
    :func:`kvchat.kernels.cpu_int4.pack`. ``q`` is rounded against the fp16 scale and minimum the kernel reads,
    so their rounding costs no more than a clamp at the group's top (scale rounded down by at most 2**-11).
    A constant group (or one whose range underflows fp16's scale) gets ``q`` 0 and its minimum.

    Raises:
        ValueError: ``in`` is not a multiple of 32, or a group's scale or minimum overflows fp16.
    """
    out_features, in_features = weight.shape
    if in_features % cpu_int8.GROUP:
        raise ValueError(f"{in_features} inputs do not split into groups of {cpu_int8.GROUP}")
    w = weight.detach().float().view(out_features, in_features // cpu_int8.GROUP, cpu_int8.GROUP)
    lo, hi = w.amin(dim=2), w.amax(dim=2)
    scale, minimum = ((hi - lo) / INT4_LEVELS).half(), lo.half()
    if not (scale.isfinite().all() and minimum.isfinite().all()):
        raise ValueError("int4 weights: a group's range or minimum is beyond fp16's")
    s, m = scale.float()[..., None], minimum.float()[..., None]
    q = torch.where(s > 0, torch.round((w - m) / torch.where(s > 0, s, 1.0)), 0.0).clamp_(0, INT4_LEVELS)
    return cpu_int4.pack(q.to(torch.uint8).view(out_features, in_features)), scale.contiguous(), minimum.contiguous()


class Int4GroupLinear(_Int8Layer):
    """``y = quantize(x) W^T (+ b)`` with ``W`` as 4-bit values, two per byte, and an fp16 scale and minimum per
    32 inputs of each output channel, and ``x`` quantized to int8 per group of 32 (the module doc's int4 scheme;
    the compiled kernel :mod:`kvchat.kernels.cpu_int4`: its group kernel up to :attr:`max_rows` rows, its
    channel-lanes kernel above, where it takes the shape).

    Attributes:
        packed: uint8 ``[out_features, in_features // 2]`` (:func:`kvchat.kernels.cpu_int4.pack`'s order).
        scale, minimum: float16 ``[out_features, in_features // 32]``.
        bias: float32 ``[out_features]`` or None.
    """

    max_rows = GROUPS_KERNEL_MAX_ROWS

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                 bias: torch.Tensor | None = None):
        super().__init__(packed.shape[0], packed.shape[1] * 2, bias)
        self.groups = scale.shape[1]
        self.register_buffer("packed", packed)
        self.register_buffer("scale", scale)
        self.register_buffer("minimum", minimum)

    @property
    def weight_bytes(self) -> int:
        """Bytes a matmul reads for the weight (packed values + fp16 scales and minima)."""
        return self.packed.numel() + (self.scale.numel() + self.minimum.numel()) * 2

    def _few_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return cpu_int4.int4_matmul(rows, self.packed, self.scale, self.minimum)

    def _many_rows(self, rows: torch.Tensor) -> torch.Tensor:
        # the channel-lanes kernel: the same product, per group and 16 channels
        return cpu_int4.int4_matmul(rows, self.packed, self.scale, self.minimum, lanes=True)


QUANTIZED_LAYERS = (Int8Linear, Int8GroupLinear, Int4GroupLinear)  # the module types a quantized load puts in


def linear_modules(model: nn.Module) -> list[tuple[str, nn.Module, str, nn.Module]]:
    """``(qualified name, parent, attribute, module)`` of every :class:`kvchat.model.transformer.Linear`, in module
    order (on the ``meta`` device too)."""
    from kvchat.model.transformer import Linear

    out = []
    for parent_name, parent in model.named_modules():
        for attr, child in parent.named_children():
            if isinstance(child, Linear):
                out.append((f"{parent_name}.{attr}" if parent_name else attr, parent, attr, child))
    return out


# how a layer is stored: int8 groups of 32 (Int8GroupLinear), int8 per channel (Int8Linear), int4 groups of 32
# (Int4GroupLinear); each kind's tensors' suffixes, in its constructor's order
KINDS = {"groups": (".q", ".scale", ".offset"), "channel": (".q", ".scale"), "int4": (".packed", ".scale", ".minimum")}


def quantize_weight(name: str, weight: torch.Tensor, kind: str) -> dict[str, torch.Tensor]:
    """The stored tensors (``{name + suffix: tensor}``, :data:`KINDS`) of the layer ``name`` whose weight is
    ``weight`` ``[out, in]`` (fp32 as loaded), quantized in the :data:`KINDS` scheme ``kind``."""
    if kind == "int4":
        parts = quantize_int4_groups(weight)
    elif kind == "groups":
        parts = quantize_int8_groups(weight)
    else:
        parts = quantize_int8(weight, group_size(name, weight.shape[1]))
    return {name + suffix: t for suffix, t in zip(KINDS[kind], parts)}


def stored_shapes(name: str, out_features: int, in_features: int, kind: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The stored tensors of a layer of ``kind``: ``{tensor name: (shape, dtype)}``."""
    g = in_features // cpu_int8.GROUP
    if kind == "int4":
        return {f"{name}.packed": ((out_features, in_features // 2), torch.uint8),
                f"{name}.scale": ((out_features, g), torch.float16), f"{name}.minimum": ((out_features, g), torch.float16)}
    if kind == "groups":
        return {f"{name}.q": ((out_features, in_features), torch.int8), f"{name}.scale": ((out_features, g), torch.float32),
                f"{name}.offset": ((out_features, g), torch.float32)}
    group = group_size(name, in_features)
    return {f"{name}.q": ((in_features // group, out_features, group), torch.int8),
            f"{name}.scale": ((in_features // group, out_features), torch.float32)}


LAYER_TYPES = {"groups": Int8GroupLinear, "channel": Int8Linear, "int4": Int4GroupLinear}


def quantized_layer(name: str, kind: str, tensors: dict[str, torch.Tensor], bias: torch.Tensor | None) -> nn.Module:
    """The :data:`LAYER_TYPES` layer of ``kind`` over ``tensors`` (``{name + suffix: tensor}`` of
    :func:`quantize_weight` or the stored file) and ``bias`` (float ``[out]`` or None)."""
    return LAYER_TYPES[kind](*(tensors[name + suffix] for suffix in KINDS[kind]), bias)


HEAD = "lm_head"  # the LM head's name among the model's linear layers


def layer_kind(name: str, in_features: int, kernel: str, bits: int) -> str | None:
    """The :data:`KINDS` scheme of the layer ``name`` with ``in_features`` inputs (None: it keeps its fp32
    weight). With ``bits`` 4 the LM head is int8 groups, as llama.cpp's Q4_K_M keeps its output matrix at 6 bits:
    SmolLM2's head is its tied embedding, which the imported GGUF holds finer than Q4_1 (~29 distinct values per
    32, against at most 16 in every other matrix), and 4 bits there cost +5% perplexity (docs/performance.md)."""
    splits = in_features % cpu_int8.GROUP == 0
    if bits == 4:  # no torch kernel takes int4: a layer the compiled one does not take stays fp32
        if name == HEAD:
            return "groups" if splits else None
        return "int4" if splits and in_features <= cpu_int4.max_inputs() else None
    return "groups" if kernel == "avx2" and splits else "channel"


def weight_scheme(bits: int, kernel: str | None = None) -> tuple[str, str]:
    """``(kernel, stored scheme)`` of ``bits``-bit weights. ``bits`` 8: ``kernel``, a
    :data:`kvchat.model.int8_scheme.SMALL_ROWS_KERNELS` name (None: :func:`kvchat.kernels.cpu_int8.small_rows_kernel`,
    the one the engine's fingerprint names): ``avx2`` gives :class:`Int8GroupLinear` layers (a layer whose inputs
    do not split into groups of 32 keeps the per-channel scheme), ``int8mm`` :class:`Int8Linear` ones. ``bits`` 4
    (``kernel`` unused, returned as ``int4``): :class:`Int4GroupLinear` layers, the LM head an
    :class:`Int8GroupLinear` (a layer whose inputs do not split into groups of 32 keeps its fp32 weight).

    Raises:
        ValueError: ``bits`` is neither 8 nor 4; ``kernel`` is ``avx2`` (or ``bits`` is 4) where the compiled
            kernel is not available.
    """
    if bits == 4:
        # the head is int8 groups
        if not (cpu_int4.available() and cpu_int8.available()):
            raise ValueError("int4 weights need the compiled CPU int4 and int8 kernels, which are not available here "
                             "(a C compiler and AVX2; KVCHAT_CPU_KERNEL not 0)")
        return "int4", INT4_SCHEME
    if bits == 8:
        kernel = kernel or cpu_int8.small_rows_kernel()
        if kernel == "avx2" and not cpu_int8.available():
            raise ValueError("the groups scheme needs the compiled CPU int8 kernel, which is not available here")
        return kernel, stored_scheme(kernel)
    raise ValueError(f"no {bits}-bit weight scheme; use 8 or 4")
