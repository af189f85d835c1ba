"""A CPU decode step's or short chunk's layers in one compiled call each (``cpu_decode.c``, linked with
``cpu_int8.c``, ``cpu_int4.c`` and ``cpu_attention.c``).

The torch code of a decode layer (:class:`kvchat.model.transformer.Block`) ran about 40 small ops per layer
around its compiled kernels: RMSNorm, RoPE, slicing, softmax, SiLU, residual adds and the kernels' ctypes
wrappers with their checks, each a few microseconds of dispatch for a few hundred floats. For a 30-layer
model that is 1,200 dispatches per token. :class:`DecodeLayers` runs each layer as one C call over plain
float32 buffers: the int8 group matmuls of :mod:`kvchat.kernels.cpu_int8` (or the int4 ones of
:mod:`kvchat.kernels.cpu_int4`), the paged cache write and
attention of :mod:`kvchat.kernels.cpu_attention`, and the small ops as loops between them (the C source
gives the formulas and the numerics). It runs decode steps (one new token per sequence, K/V provisional) and
short chunks of one sequence (a question after a resume: ``tokens`` new tokens that read each cached K/V
range of the pool once between them). Its rounding (another summation order, a polynomial exp) differs from
the torch layers', so the engine runs every chunk of a size it takes here, cold or resumed alike
(:data:`kvchat.model.int8_scheme.COMPILED_LAYER_MAX_TOKENS`).

Built and loaded by :mod:`kvchat.kernels.cpu_build`; where it cannot be (``KVCHAT_CPU_KERNEL=0``, no
compiler, no AVX2) :func:`available` is False and the torch layers run.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from .cpu_attention import KINDS, pool_pointers, takes_pool
from .cpu_attention import SOURCE as ATTENTION_SOURCE
from .cpu_build import integer_variant
from .cpu_build import load as load_library
from .cpu_int4 import SOURCE as INT4_SOURCE
from .cpu_int8 import GROUP
from .cpu_int8 import SOURCE as INT8_SOURCE
from .layout import KVLayer

SOURCE = Path(__file__).with_name("cpu_decode.c")
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class _Weight(ctypes.Structure):
    _fields_ = [("q", _P), ("scale", _P), ("offset", _P), ("bias", _P), ("n", _I64), ("k", _I64), ("bits", _I64)]


class _Layer(ctypes.Structure):
    _fields_ = [("attn_norm", _P), ("mlp_norm", _P), ("qkv", _Weight), ("o", _Weight),
                ("gate_up", _Weight), ("down", _Weight), ("k_shift", _P), ("k_cache", _P), ("v_cache", _P),
                ("k_scale", _P), ("v_scale", _P), ("index", _I64)]


class _Step(ctypes.Structure):
    _fields_ = [(n, _I64) for n in ("rows", "hidden", "heads", "kv_heads", "head_dim", "inter", "block_size",
                                    "table_stride", "num_layers", "tokens")] + [
        ("table", _P), ("lens", _P), ("slots", _P), ("cos", _P), ("sin", _P), ("sink_k", _P), ("sink_v", _P),
        ("eps", ctypes.c_float), ("sm_scale", ctypes.c_float), ("kind", ctypes.c_int), ("threads", ctypes.c_int),
        ("scratch", _P)]


@functools.cache
def _library() -> ctypes.CDLL | None:
    # the int4 kernel's integer dot products: the VNNI build where the CPU has it (the other sources' bits are
    # the same in every build)
    lib = load_library(SOURCE, INT8_SOURCE, INT4_SOURCE, ATTENTION_SOURCE, variant=integer_variant())
    if lib is not None:
        lib.kvchat_decode_layer.restype = None
        lib.kvchat_decode_layer.argtypes = [_P, _P, _P]
        lib.kvchat_decode_scratch_floats.restype = _I64
        lib.kvchat_decode_scratch_floats.argtypes = [ctypes.POINTER(_Step), _I64]
        lib.kvchat_int4_max_groups.restype = _I64
        lib.kvchat_int4_max_groups.argtypes = []
    return lib


def available() -> bool:
    """Whether the compiled decode layer is usable in this process (built or found on first call)."""
    return _library() is not None


@dataclass(frozen=True, slots=True)
class GroupWeight:
    """A group weight as its kernel takes it, all contiguous; ``bias`` float32 ``[out]`` or None.

    ``bits`` 8: :func:`kvchat.kernels.cpu_int8.int8_matmul`'s, ``q`` int8 ``[out, in]``, ``scale`` and ``offset``
    float32 ``[out, in // 32]``. ``bits`` 4: :func:`kvchat.kernels.cpu_int4.int4_matmul`'s, ``q`` the packed
    uint8 ``[out, in // 2]``, ``scale`` and ``offset`` (the minimum) float16 ``[out, in // 32]``."""

    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    bias: torch.Tensor | None = None
    bits: int = 8


@dataclass(frozen=True, slots=True)
class LayerTensors:
    """One decoder layer's tensors (float32 CPU, contiguous, held by the caller's model and pool).

    Attributes:
        attn_norm, mlp_norm: RMSNorm weights ``[hidden]``.
        qkv: ``[(heads + 2 kv_heads) * head_dim, hidden]`` (q heads, k heads, v heads); o ``[hidden, heads *
            head_dim]``; gate_up ``[2 inter, hidden]`` (gate rows, then up); down ``[hidden, inter]``.
        k_shift: ``[kv_heads, head_dim]`` subtracted from post-RoPE K before it is stored, or None
            (:class:`kvchat.model.transformer.Attention`).
        pool: the layer's pools (:meth:`kvchat.engine.kv_pool.KVPool.layer`).
    """

    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    qkv: GroupWeight
    o: GroupWeight
    gate_up: GroupWeight
    down: GroupWeight
    k_shift: torch.Tensor | None
    pool: KVLayer


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _is_f32(t: torch.Tensor | None, shape: tuple[int, ...]) -> bool:
    return (t is not None and t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
            and tuple(t.shape) == shape)


def _takes_weight(w: GroupWeight, out_features: int, in_features: int) -> bool:
    """Whether ``w`` is a :class:`GroupWeight` of this shape in a layout the C takes (the library loaded)."""
    if w.bias is not None and not _is_f32(w.bias, (out_features,)):
        return False
    if w.bits == 4:
        return (tuple(w.q.shape) == (out_features, in_features // 2) and in_features <= GROUP * _library().kvchat_int4_max_groups()
                and in_features % GROUP == 0 and w.q.dtype == torch.uint8 and w.q.is_contiguous()
                and w.q.device.type == "cpu"
                and all(t.dtype == torch.float16 and t.device.type == "cpu" and t.is_contiguous()
                        and tuple(t.shape) == (out_features, in_features // GROUP) for t in (w.scale, w.offset)))
    return (w.bits == 8 and w.q.dtype == torch.int8 and w.q.device.type == "cpu" and w.q.is_contiguous()
            and tuple(w.q.shape) == (out_features, in_features) and in_features % GROUP == 0
            and _is_f32(w.scale, (out_features, in_features // GROUP))
            and _is_f32(w.offset, (out_features, in_features // GROUP)))


class DecodeLayers:
    """A model's decoder layers as the compiled decode steps and short chunks run them (see the module doc).

    The tensors' addresses are read once, here: a layer's weights, norms, K shift or pool replaced later
    are not seen (the engine sets them all before it builds this). One step at a time: :meth:`run` reuses
    one step record and one scratch buffer (the engine's one thread drives it).

    Args:
        layers: each layer's tensors, in order (kept referenced: the C reads them through pointers).
        heads, kv_heads, head_dim, hidden, inter: the model's shape (``heads`` a multiple of ``kv_heads``).
        eps: RMSNorm's epsilon. sm_scale: the attention's score scale (``head_dim ** -0.5``).
    Raises:
        ValueError: the layers' tensors or pools are not what the C takes (:meth:`takes` says which do).
        RuntimeError: the library is not :func:`available`.
    """

    def __init__(self, layers: list[LayerTensors], *, heads: int, kv_heads: int, head_dim: int, hidden: int,
                 inter: int, eps: float, sm_scale: float):
        lib = _library()
        if lib is None:
            raise RuntimeError("the compiled CPU decode layer is not available")
        if not self.takes(layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim, hidden=hidden, inter=inter):
            raise ValueError("decode layers: tensors or pools of a layout the compiled decode step does not take")
        self._lib, self._layers = lib, layers
        k_cache = layers[0].pool.k_cache
        self._slots_in_pool = k_cache.shape[0] * k_cache.shape[1]
        self._block_size = k_cache.shape[1]
        self._structs = (_Layer * len(layers))()
        for i, (t, c) in enumerate(zip(layers, self._structs)):
            c.attn_norm, c.mlp_norm, c.k_shift, c.index = t.attn_norm.data_ptr(), t.mlp_norm.data_ptr(), _ptr(t.k_shift), i
            for name in ("qkv", "o", "gate_up", "down"):
                w = getattr(t, name)
                setattr(c, name, _Weight(w.q.data_ptr(), w.scale.data_ptr(), w.offset.data_ptr(), _ptr(w.bias),
                                         w.q.shape[0], w.q.shape[1] * 8 // w.bits, w.bits))
            c.k_cache, c.v_cache, c.k_scale, c.v_scale = pool_pointers(t.pool)
        self._addresses = [ctypes.addressof(c) for c in self._structs]
        self._step = _Step(hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim, inter=inter,
                           block_size=self._block_size, num_layers=len(layers), eps=eps, sm_scale=sm_scale,
                           kind=KINDS[k_cache.dtype])
        self._shape = (heads, kv_heads, head_dim, hidden)
        self._scratch = torch.empty(0, dtype=torch.float32)
        self._scratch_for: dict[tuple[int, int, int], int] = {}

    @staticmethod
    def takes(layers: list[LayerTensors], *, heads: int, kv_heads: int, head_dim: int, hidden: int, inter: int) -> bool:
        """Whether these layers run here: float32 norms and K shift, int8 or int4 group weights
        (:class:`GroupWeight`) of the model's shape (every input width a multiple of 32), pools the compiled attention reads
        (:func:`kvchat.kernels.cpu_attention.takes_pool`: ``head_dim`` a multiple of 16 among them)."""
        if not layers or heads % kv_heads or not available():
            return False
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        return all(
            _is_f32(t.attn_norm, (hidden,)) and _is_f32(t.mlp_norm, (hidden,))
            and (t.k_shift is None or _is_f32(t.k_shift, (kv_heads, head_dim)))
            and _takes_weight(t.qkv, q_size + 2 * kv_size, hidden) and _takes_weight(t.o, hidden, q_size)
            and _takes_weight(t.gate_up, 2 * inter, hidden) and _takes_weight(t.down, hidden, inter)
            and takes_pool(t.pool) and tuple(t.pool.k_cache.shape[2:]) == (kv_heads, head_dim)
            and t.pool.k_cache.dtype == layers[0].pool.k_cache.dtype and t.pool.k_cache.shape == layers[0].pool.k_cache.shape
            for t in layers)

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
            block_table: torch.Tensor, seq_lens: torch.Tensor, sink: tuple[torch.Tensor, torch.Tensor] | None,
            tokens: int = 1) -> None:
        """Every layer over ``R`` rows, ``x`` updated in place: ``S = R / tokens`` sequences of ``tokens``
        consecutive new tokens each (row ``s * tokens + t``); a decode step has ``tokens == 1``.

        Args:
            x: float32 ``[R, hidden]`` contiguous, the embedded tokens; on return the last layer's output
                (before the final norm).
            cos, sin: float32 ``[R, 1, head_dim]`` contiguous (:meth:`kvchat.model.transformer.Transformer.rope`).
            slot_mapping: int64 ``[R]`` pool slot of each row's new token (-1: not written).
            block_table: int32 ``[S, width]`` (columns contiguous, any row stride); seq_lens: int32 ``[S]``
                contiguous, the new tokens included (0: a padded decode row, output zeros); token ``t`` of
                sequence ``s`` attends to its first ``seq_lens[s] - tokens + 1 + t`` tokens.
            sink: float32 ``[S, num_layers, kv_heads, head_dim]`` contiguous x2, exact position-0 K/V, or None.
            tokens: new tokens per sequence: 1 (a decode step, any ``S``) or more for one sequence (a chunk).
        Raises:
            ValueError: arguments of another shape, dtype or layout, ``R`` not ``tokens`` (``tokens > 1``), a
                length under ``tokens`` (``tokens > 1``) or past the block table, or a slot outside the pool
                (the C reads and writes unchecked).
        """
        r = x.shape[0]
        heads, kv_heads, head_dim, hidden = self._shape
        width = block_table.shape[1]
        seqs = r // tokens if tokens >= 1 else 0
        sink_shape = (seqs, len(self._layers), kv_heads, head_dim)
        if not (r >= 1 and seqs * tokens == r and (tokens == 1 or seqs == 1)
                and _is_f32(x, (r, hidden)) and _is_f32(cos, (r, 1, head_dim)) and _is_f32(sin, (r, 1, head_dim))
                and slot_mapping.dtype == torch.int64 and tuple(slot_mapping.shape) == (r,) and slot_mapping.is_contiguous()
                and block_table.dtype == torch.int32 and block_table.dim() == 2 and block_table.shape[0] == seqs
                and block_table.stride(1) == 1 and seq_lens.dtype == torch.int32 and tuple(seq_lens.shape) == (seqs,)
                and seq_lens.is_contiguous()
                and all(t.device.type == "cpu" for t in (slot_mapping, block_table, seq_lens))
                and (sink is None or all(_is_f32(s, sink_shape) for s in sink))):
            raise ValueError(f"compiled decode layers: x {tuple(x.shape)} {x.dtype}, {tokens} tokens per sequence, "
                             f"block table {tuple(block_table.shape)} {block_table.dtype}: not what it takes")
        longest, shortest, slot_max = int(seq_lens.max()), int(seq_lens.min()), int(slot_mapping.max())
        if (shortest < (0 if tokens == 1 else tokens) or longest > width * self._block_size
                or slot_max >= self._slots_in_pool):
            raise ValueError(f"compiled decode layers: lengths {shortest}..{longest} under {tokens} new tokens or past "
                             f"a block table of {width} blocks of {self._block_size} tokens, or slot {slot_max} "
                             f"outside a pool of {self._slots_in_pool}")
        s = self._step
        s.rows, s.tokens, s.table_stride, s.threads = r, tokens, block_table.stride(0), torch.get_num_threads()
        s.table, s.lens, s.slots = block_table.data_ptr(), seq_lens.data_ptr(), slot_mapping.data_ptr()
        s.cos, s.sin = cos.data_ptr(), sin.data_ptr()
        s.sink_k, s.sink_v = (None, None) if sink is None else (sink[0].data_ptr(), sink[1].data_ptr())
        key = (r, width, s.threads)
        need = self._scratch_for.get(key)
        if need is None:
            need = self._scratch_for[key] = self._lib.kvchat_decode_scratch_floats(ctypes.byref(s), width * self._block_size)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.float32)
        s.scratch = self._scratch.data_ptr()
        step, fn = ctypes.addressof(s), self._lib.kvchat_decode_layer
        xp = x.data_ptr()
        for layer in self._addresses:
            fn(xp, layer, step)
