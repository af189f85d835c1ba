"""int8 weight-only linear layers for the CPU, quantized once per model and stored beside it.

Two schemes, chosen by whether the compiled kernel runs here
(:func:`kvchat.kernels.cpu_int8.small_rows_kernel`); each has its own name in
the cache fingerprint (:func:`kvchat.model.int8_scheme.int8_compute_scheme`).
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

The int8 tensors live in ``models_dir()/.weights/<model fingerprint>.<scheme>.safetensors``
(:func:`int8_path`; written atomically on first use, read on every later load).
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kvchat.kernels import cpu_int8, cpu_int8_int8
from kvchat.load_steps import step
from kvchat.model.int8_scheme import GROUP_SIZES, GROUPS_KERNEL_MAX_ROWS, INT8MM_MAX_ROWS, stored_scheme
from kvchat.paths import models_dir
from kvchat.safetensors_file import save_atomic

WEIGHTS_DIR = ".weights"
QMAX = 127

_scratch = threading.local()  # one fp32 buffer per thread for the dequantized weight of the large-M path


def int8_path(model_fingerprint: str, scheme: str) -> Path:
    """Where a model's int8 weights in ``scheme`` (:func:`kvchat.model.int8_scheme.stored_scheme`) live: the
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
        # plan (kvchat.engine.runner.ExecutionPlan.int8_prefill), never per call
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


INT8_LAYERS = (Int8Linear, Int8GroupLinear)  # the module types quantize_linears puts in


def _linears(model: nn.Module) -> list[tuple[str, nn.Module, str, nn.Linear]]:
    """``(qualified name, parent, attribute, module)`` of every :class:`kvchat.model.transformer.Linear`, in module order."""
    from kvchat.model.transformer import Linear

    out = []
    for parent_name, parent in model.named_modules():
        for attr, child in parent.named_children():
            if isinstance(child, Linear):
                out.append((f"{parent_name}.{attr}" if parent_name else attr, parent, attr, child))
    return out


def load_int8(path: Path, scheme: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor] | None:
    """The stored tensors at ``path`` (``{tensor name: tensor}``), or None when absent, unreadable, of another
    ``scheme``, or not exactly ``shapes`` (``{tensor name: shape}``; names ending ``.q`` int8, the others
    float32 and finite)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            if (f.metadata() or {}).get("scheme") != scheme or set(f.keys()) != set(shapes):
                return None
            # copies: a tensor read from the file can start at any byte (56 mod 64 seen here), and the int8
            # kernel crashes (SIGSEGV) on a weight that is not aligned the way torch's allocator aligns it
            out = {n: f.get_tensor(n).clone() for n in shapes}
    except (OSError, SafetensorError):
        return None
    for n, t in out.items():
        want = torch.int8 if n.endswith(".q") else torch.float32
        if t.dtype != want or tuple(t.shape) != shapes[n] or (want == torch.float32 and not bool(t.isfinite().all())):
            return None
    return out


def _quantized(name: str, lin: nn.Module, groups: bool) -> dict[str, torch.Tensor]:
    """``lin``'s tensors under ``name`` in the scheme (``groups``: :func:`quantize_int8_groups`)."""
    if groups:
        q, scale, offset = quantize_int8_groups(lin.weight)
        return {f"{name}.q": q, f"{name}.scale": scale, f"{name}.offset": offset}
    q, scale = quantize_int8(lin.weight, group_size(name, lin.weight.shape[1]))
    return {f"{name}.q": q, f"{name}.scale": scale}


def _shapes(name: str, out_features: int, in_features: int, groups: bool) -> dict[str, tuple[int, ...]]:
    if groups:
        g = in_features // cpu_int8.GROUP
        return {f"{name}.q": (out_features, in_features), f"{name}.scale": (out_features, g),
                f"{name}.offset": (out_features, g)}
    group = group_size(name, in_features)
    return {f"{name}.q": (in_features // group, out_features, group), f"{name}.scale": (in_features // group, out_features)}


def quantize_linears(model: nn.Module, path: Path | None, kernel: str | None = None) -> bool:
    """Replace every :class:`kvchat.model.transformer.Linear` of ``model`` (loaded) by an int8 layer.

    ``kernel``: a :data:`kvchat.model.int8_scheme.SMALL_ROWS_KERNELS` name (None:
    :func:`kvchat.kernels.cpu_int8.small_rows_kernel`, the one the engine's fingerprint names): ``avx2``
    gives :class:`Int8GroupLinear` layers (a layer whose inputs do not split into groups of 32 keeps the
    per-channel scheme), ``int8mm`` :class:`Int8Linear` ones. The tensors are read from ``path`` when it
    holds this scheme for exactly these layers; otherwise they are quantized and written there
    (atomically; with a read-only models dir they are quantized again on the next load). ``path`` None:
    quantize, store nothing.

    Returns:
        True when the tensors came from ``path``.
    Raises:
        ValueError: ``kernel`` is ``avx2`` where the compiled kernel is not available.
    """
    kernel = kernel or cpu_int8.small_rows_kernel()
    if kernel == "avx2" and not cpu_int8.available():
        raise ValueError("the groups scheme needs the compiled CPU int8 kernel, which is not available here")
    groups_scheme = kernel == "avx2"
    scheme = stored_scheme(kernel)
    found = _linears(model)
    grouped = {name: groups_scheme and m.weight.shape[1] % cpu_int8.GROUP == 0 for name, _, _, m in found}
    shapes = {}
    for name, _, _, m in found:
        shapes.update(_shapes(name, *m.weight.shape, grouped[name]))
    stored = load_int8(path, scheme, shapes) if path is not None else None
    if stored is None:
        step(f"quantizing {len(found)} weight matrices to int8" + (" (once per model)" if path is not None else ""),
             first_time=path is not None)
    tensors = {}
    for name, parent, attr, lin in found:
        t = ({k: v for k, v in stored.items() if k.rpartition(".")[0] == name} if stored is not None
             else _quantized(name, lin, grouped[name]))
        dev = lin.weight.device
        bias = lin.bias.detach() if lin.bias is not None else None
        if grouped[name]:
            layer = Int8GroupLinear(t[f"{name}.q"].to(dev), t[f"{name}.scale"].to(dev), t[f"{name}.offset"].to(dev), bias)
        else:
            layer = Int8Linear(t[f"{name}.q"].to(dev), t[f"{name}.scale"].to(dev), bias)
        setattr(parent, attr, layer)
        tensors.update({k: v.cpu() for k, v in t.items()})
    if stored is None and path is not None:
        try:
            save_atomic(tensors, path, {"scheme": scheme})
        except OSError:
            pass  # a read-only models dir: quantized again on the next load (a second or so)
    return stored is not None
