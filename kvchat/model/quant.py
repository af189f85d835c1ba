"""int8 weight-only linear layers for the CPU, quantized once per model and stored beside it.

Scheme (``INT8_SCHEME``): symmetric absmax, one fp32 scale per output
channel and group of ``group`` input columns, ``scale = max(|w|) / 127``,
``q = round(w / scale)`` in ``[-127, 127]`` (the weight-only absmax scheme of
Dettmers et al. 2022, LLM.int8(), without its outlier split). Groups span
the whole row (per output channel, the layout ``_weight_int8pack_mm`` takes)
except in ``down_proj`` (``GROUP_SIZES``): measured on SmolLM2, 2,047
teacher-forced positions of a seed article, bf16 pool, against fp32 weights,
per channel everywhere costs +0.76% perplexity, and down_proj alone, whose
1,536 inputs carry the outliers, accounts for most of it (+0.25% with it left
in fp32; +0.12% with groups of 256 there, +0.09% with groups of 64
everywhere, which would cost 9-24 kernel calls per layer). A grouped layer
runs one kernel call per group and sums them in fp32. Only the linear
layers are quantized (q/k/v, o, gate/up, down and the LM head); embeddings,
norms, RoPE, attention, softmax and logits stay fp32.

Three kernels, chosen by the number of input rows ``M`` alone (so a cold run
and a resumed run, which cut the same chunks, compute the same numbers):

- ``M <= CPU_KERNEL_MAX_ROWS`` (decode, a question after a resume), where
  the compiled kernel builds (:mod:`kvchat.kernels.cpu_int8`, AVX2 + FMA):
  fp32 activations as they are, each group's dot product scaled by its fp32
  scale;
- up to ``INT8MM_MAX_ROWS`` (and every few-row matmul where that kernel is
  not built): ``torch._weight_int8pack_mm`` with the activations cast to
  bf16 at its input (its CPU kernel is vectorized for bf16 activations only;
  with fp32 ones it falls back to scalar code, ~15x slower), unit scales,
  the accumulated row then multiplied by the fp32 scales (a bf16 copy of the
  scales would bias every channel by up to 0.4%);
- larger ``M`` (512-token prefill chunks): the weight dequantized to fp32
  into a reused scratch buffer and an fp32 GEMM, which at ``M = 512`` beats
  the int8 kernel (measured here, 2 threads, the 120 layer matmuls of
  SmolLM2: int8mm 2.7 s, dequantize + fp32 2.1 s, fp32 weights 1.8 s; at
  ``M = 128`` 0.67 / 0.98 / 1.10 s; at ``M = 15`` 0.11 / 0.20 / 0.15 s).

The int8 tensors live in ``models_dir()/.weights/<model fingerprint>.int8.safetensors``
(written atomically on first use, read on every later load); the scheme
name, with the few-row kernel's, is part of the cache fingerprint
(:func:`kvchat.model.int8_scheme.int8_compute_scheme`).
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kvchat.kernels import cpu_int8
from kvchat.model.int8_scheme import CPU_KERNEL_MAX_ROWS, GROUP_SIZES, INT8_SCHEME, INT8MM_MAX_ROWS
from kvchat.paths import models_dir
from kvchat.safetensors_file import save_atomic

WEIGHTS_DIR = ".weights"
QMAX = 127

_scratch = threading.local()  # one fp32 buffer per thread for the dequantized weight of the large-M path


def int8_path(model_fingerprint: str) -> Path:
    """Where a model's int8 weights live (the models dir, beside its calibration)."""
    return models_dir() / WEIGHTS_DIR / f"{model_fingerprint}.int8.safetensors"


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


class Int8Linear(nn.Module):
    """``y = x W^T (+ b)`` with ``W`` held as int8 groups and fp32 scales; see the module doc for the two kernels.

    Attributes:
        q: int8 ``[G, out_features, in_features // G]`` (each ``q[g]`` contiguous, as the kernels take it).
        scale: float32 ``[G, out_features]``.
        bias: float32 ``[out_features]`` or None.
        compiled: few-row matmuls run on the compiled kernel (``kernel`` ``avx2`` and a group it takes).
    """

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 kernel: str | None = None):
        """``kernel``: the few-row kernel, a :data:`kvchat.model.int8_scheme.SMALL_ROWS_KERNELS` name
        (None: :func:`kvchat.kernels.cpu_int8.small_rows_kernel`, the one the engine's fingerprint names)."""
        super().__init__()
        self.groups, self.out_features, self.group = q.shape
        self.in_features = self.groups * self.group
        kernel = kernel or cpu_int8.small_rows_kernel()
        self.compiled = kernel == "avx2" and q.device.type == "cpu" and self.group % cpu_int8.GROUP_MULTIPLE == 0
        self.register_buffer("q", q)
        self.register_buffer("scale", scale.float())
        self.register_buffer("unit", torch.ones(self.out_features, dtype=torch.bfloat16, device=q.device),
                             persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    @property
    def weight_bytes(self) -> int:
        """Bytes a matmul reads for the weight (int8 values + fp32 scales)."""
        return self.q.numel() + self.scale.numel() * 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` float32 ``[..., in_features]`` -> float32 ``[..., out_features]``."""
        rows = x.reshape(-1, self.in_features)
        if self.compiled and rows.shape[0] <= CPU_KERNEL_MAX_ROWS:
            y = cpu_int8.int8_matmul(rows, self.q, self.scale)
        elif rows.shape[0] <= INT8MM_MAX_ROWS:
            xb = rows.to(torch.bfloat16, memory_format=torch.contiguous_format)  # the kernel reads rows densely
            if self.groups == 1:
                y = torch._weight_int8pack_mm(xb, self.q[0], self.unit).float().mul_(self.scale[0])
            else:
                xg = xb.view(-1, self.groups, self.group).transpose(0, 1).contiguous()
                y = torch._weight_int8pack_mm(xg[0], self.q[0], self.unit).float().mul_(self.scale[0])
                for g in range(1, self.groups):
                    y.add_(torch._weight_int8pack_mm(xg[g], self.q[g], self.unit).float().mul_(self.scale[g]))
        else:
            y = F.linear(rows, self._dequantized())
        if self.bias is not None:
            y.add_(self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def _dequantized(self) -> torch.Tensor:
        """The fp32 weight ``[out, in]`` in this thread's scratch buffer (valid until the next call)."""
        n = self.q.numel()
        buf = getattr(_scratch, "buf", None)
        if buf is None or buf.numel() < n or buf.device != self.q.device:
            with torch.inference_mode(False):  # a normal tensor: written in and out of inference mode alike
                buf = _scratch.buf = torch.empty(n, device=self.q.device)
        w = buf[:n].view(self.out_features, self.groups, self.group)
        w.copy_(self.q.transpose(0, 1)).mul_(self.scale.t()[..., None])
        return w.view(self.out_features, self.in_features)


def _linears(model: nn.Module) -> list[tuple[str, nn.Module, str, nn.Linear]]:
    """``(qualified name, parent, attribute, module)`` of every :class:`kvchat.model.transformer.Linear`, in module order."""
    from kvchat.model.transformer import Linear

    out = []
    for parent_name, parent in model.named_modules():
        for attr, child in parent.named_children():
            if isinstance(child, Linear):
                out.append((f"{parent_name}.{attr}" if parent_name else attr, parent, attr, child))
    return out


def load_int8(path: Path, names_shapes: dict[str, tuple[int, int, int]]) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
    """The stored ``{name: (q, scale)}`` at ``path``, or None when absent, unreadable, of another scheme,
    or not matching ``names_shapes`` (``{name: q's shape (G, out, group)}``) exactly."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            if (f.metadata() or {}).get("scheme") != INT8_SCHEME:
                return None
            keys = set(f.keys())
            if keys != {f"{n}.{s}" for n in names_shapes for s in ("q", "scale")}:
                return None
            # copies: a tensor read from the file can start at any byte (56 mod 64 seen here), and the int8
            # kernel crashes (SIGSEGV) on a weight that is not aligned the way torch's allocator aligns it
            out = {n: (f.get_tensor(f"{n}.q").clone(), f.get_tensor(f"{n}.scale").clone()) for n in names_shapes}
    except (OSError, SafetensorError):
        return None
    for n, (q, s) in out.items():
        if q.dtype != torch.int8 or tuple(q.shape) != names_shapes[n] or s.dtype != torch.float32 \
                or tuple(s.shape) != names_shapes[n][:2] or not bool(s.isfinite().all()):
            return None
    return out


def quantize_linears(model: nn.Module, path: Path | None, kernel: str | None = None) -> bool:
    """Replace every :class:`kvchat.model.transformer.Linear` of ``model`` (loaded) by an :class:`Int8Linear`.

    The int8 tensors are read from ``path`` when it holds this scheme for
    exactly these layers; otherwise they are quantized (:func:`quantize_int8`)
    and written there (atomically; with a read-only models dir they are
    quantized again on the next load). ``path`` None: quantize, store nothing.
    ``kernel``: the layers' few-row kernel (see :class:`Int8Linear`).

    Returns:
        True when the tensors came from ``path``.
    """
    found = _linears(model)
    shapes = {}
    for name, _, _, m in found:
        out_features, in_features = m.weight.shape
        group = group_size(name, in_features)
        shapes[name] = (in_features // group, out_features, group)
    stored = load_int8(path, shapes) if path is not None else None
    tensors = {}
    for name, parent, attr, lin in found:
        q, scale = stored[name] if stored is not None else quantize_int8(lin.weight, shapes[name][2])
        bias = lin.bias.detach() if lin.bias is not None else None
        setattr(parent, attr, Int8Linear(q.to(lin.weight.device), scale.to(lin.weight.device), bias, kernel))
        tensors[f"{name}.q"], tensors[f"{name}.scale"] = q.cpu(), scale.cpu()
    if stored is None and path is not None:
        try:
            save_atomic(tensors, path, {"scheme": INT8_SCHEME})
        except OSError:
            pass  # a read-only models dir: quantized again on the next load (a second or so)
    return stored is not None
