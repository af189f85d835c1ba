"""Cache identity: what must match for stored K/V to be reused.

Anything that changes the stored numbers is part of the fingerprint, so a
difference always misses (docs/architecture.md, "The KV cache on disk").
Bump ``NUMERICS_VERSION`` whenever a runner or kernel fix changes K/V values
(a RoPE fix must not silently restore stale caches).

Every fact of a cache's identity is here, once: the KV dtype names, the
fingerprint's inputs, the fp8 scheme names, an engine's identity as one
object (:class:`CacheIdentity`, whose fingerprint the engine and ``cache
explain`` both read), the weight formats and what ``auto`` picks
(:func:`resolve_weight_format`), what a model and KV dtype would get without
loading it (:func:`expected_identity`), and every variant a store may hold
(:func:`fingerprint_variants`). Importing this module imports no torch; the
functions that name fp8 schemes do.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

BLOCK_SIZE = 16  # tokens per KV block (vLLM's default)
KV_DTYPE_NAMES = ("fp8", "bf16", "fp16")  # the pool dtypes a cache can be stored in (torch dtypes: kv_pool.KV_DTYPES)
WEIGHT_FORMATS = ("fp32", "bf16", "int8", "int4")  # what the linear layers compute with (int8, int4: kvchat.model.quant)
CPU_ONLY_FORMATS = ("int8", "int4")  # weight formats whose kernels run on a CPU only
COMPUTE_NAMES = ("bf16", "fp16", "fp32")  # the compute dtypes KVCHAT_DTYPE / --dtype name (besides auto)
# the compute dtype of each weight format when KVCHAT_DTYPE is auto; int8: fp32 everywhere but torch's int8
# kernel's bf16 input where it runs (kvchat.model.quant), and no other (kvchat.engine.runner.Engine refuses it);
# int4: fp32, and no other
FORMAT_COMPUTE = {"fp32": "fp32", "bf16": "bf16", "int8": "fp32", "int4": "fp32"}
LAYOUT_VERSION = 1
NUMERICS_VERSION = 2  # 2: CPU attention over the dense K/V copy; answers recomputed as prefill chunks


# from this many parameters (as stored: kvchat.model.weights.CheckpointReader.num_params) ``auto`` on a CPU is
# int4, below it int8 (the measurements and why: resolve_weight_format)
INT4_AUTO_PARAMS = 500_000_000


def resolve_weight_format(name: str, device_type: str, compute: str = "auto", *, num_params: int) -> str:
    """``auto|fp32|bf16|int8|int4`` -> a :data:`WEIGHT_FORMATS` name for a device of type ``device_type``.

    ``auto`` is what measured fastest where its fidelity holds: on CUDA bf16; on a CPU, by the model's
    ``num_params`` (stored parameters, :meth:`kvchat.model.weights.CheckpointReader.num_params`; 0 to validate a
    name before the model is at hand), int4 from :data:`INT4_AUTO_PARAMS` where its compiled kernels run
    (:func:`int4_runs`), int8 below or without them. A CPU decode step is
    bound by the weight bytes it reads (int8 groups 1.25 bytes per parameter, int4 0.625: decode of the 0.8B
    shape about 2x int8's, its integer prefill about 2.5x; docs/performance.md, "4-bit weights" and "The weight
    format by model size"), while a small model loses the most to 4 bits and gains the least (SmolLM2-135M: int4
    up to +0.81% perplexity against fp32 weights, its LM head a fifth of its bytes and kept int8). ``compute``
    (the ``KVCHAT_DTYPE``/``--dtype`` name) asking for a 16-bit computation makes ``auto`` that computation's
    unquantized format (bf16 -> bf16; fp16 -> fp32 weights computed in fp16), so one computation has one cache
    fingerprint however it was asked for.

    Raises:
        ValueError: an unknown name, or int8 or int4 on a device other than the CPU.
    """
    if name == "auto":
        cpu = "int4" if num_params >= INT4_AUTO_PARAMS and device_type == "cpu" and int4_runs() else "int8"
        fmt = {"bf16": "bf16", "fp16": "fp32"}.get(compute, cpu if device_type == "cpu" else "bf16")
    else:
        fmt = name
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {name!r}; use auto, {', '.join(WEIGHT_FORMATS)}")
    if fmt in CPU_ONLY_FORMATS and device_type != "cpu":
        raise ValueError(f"{fmt} weights run on the CPU only; use --weights bf16 on {device_type}")
    return fmt


def int4_runs() -> bool:
    """Whether int4 weights can run in this process: their compiled CPU kernels and the int8 one of the LM head
    build and load (:func:`kvchat.model.quant.weight_scheme`; ``KVCHAT_CPU_KERNEL=0`` among the reasons not)."""
    from kvchat.kernels import cpu_int4, cpu_int8

    return cpu_int4.available() and cpu_int8.available()


def compute_key(weight_format: str, dtype_name: str) -> str | None:
    """The compute dtype as it enters the cache fingerprint (``compute``): None when ``dtype_name``
    (``auto`` or a :data:`COMPUTE_NAMES` name) is what ``weight_format`` computes in anyway, else the name."""
    return None if dtype_name in ("auto", FORMAT_COMPUTE[weight_format]) else dtype_name


def compute_keys(weight_format: str) -> tuple[str | None, ...]:
    """Every ``compute`` key an engine with ``weight_format`` may have (None: the format's own dtype)."""
    if weight_format in CPU_ONLY_FORMATS:
        return (None,)
    return (None, *(n for n in COMPUTE_NAMES if n != FORMAT_COMPUTE[weight_format]))


def weight_scheme(weight_format: str, int8_kernel: str | None = None, compiled_layers: bool = False,
                  int8_prefill: bool = False) -> str:
    """The name a weight format enters the cache fingerprint with ("" for fp32: fingerprints made before
    weight formats existed stay valid; the int8 name carries its kernel choice, which changes K/V; the int4 name
    is :func:`kvchat.model.int4_scheme.int4_compute_scheme`'s).

    ``int8_kernel``: a :data:`kvchat.model.int8_scheme.SMALL_ROWS_KERNELS` name; None: this process's
    (:func:`kvchat.kernels.cpu_int8.small_rows_kernel`, which imports torch and may build the kernel).
    ``compiled_layers``: short chunks run the compiled decoder layers (:attr:`kvchat.engine.runner.Engine.compiled_decode`).
    ``int8_prefill``: longer chunks run int8 activations on the integer kernel (:func:`int8_prefill_enabled`).
    """
    if weight_format == "int8":
        from kvchat.model.int8_scheme import int8_compute_scheme

        if int8_kernel is None:
            from kvchat.kernels.cpu_int8 import small_rows_kernel

            int8_kernel = small_rows_kernel()
        return int8_compute_scheme(int8_kernel, compiled_layers, int8_prefill)
    if weight_format == "int4":
        from kvchat.model.int4_scheme import int4_compute_scheme

        return int4_compute_scheme(compiled_layers)
    return "" if weight_format == "fp32" else weight_format


def int8_prefill_enabled(choice: str, int8_kernel: str | None) -> bool:
    """Whether an engine's int8 prefill chunks run int8 activations on the integer kernel: ``choice``
    (``auto|int8|float``, :func:`kvchat.settings.int8_prefill`; ``auto`` is
    :data:`kvchat.model.int8_scheme.DEFAULT_INT8_PREFILL`) says ``int8``, the engine has the groups scheme
    (``int8_kernel`` ``avx2``) and :mod:`kvchat.kernels.cpu_int8_int8` builds here (else the fp32 GEMM)."""
    from kvchat.model.int8_scheme import DEFAULT_INT8_PREFILL

    if (DEFAULT_INT8_PREFILL if choice == "auto" else choice) != "int8" or int8_kernel != "avx2":
        return False
    from kvchat.kernels import cpu_int8_int8

    return cpu_int8_int8.available()


def cache_fingerprint(model_fingerprint: str, kv_dtype: str, scale_scheme: str, block_size: int, calibration: str = "",
                      *, compute: str = "", weights: str = "") -> str:
    """Hex blake2b-128 over the canonical JSON of every input that shapes the K/V bytes.

    Args:
        model_fingerprint: weights + tokenizer + chat template + RoPE (see kvchat.model.fingerprint).
        kv_dtype: ``fp8|bf16|fp16``.
        scale_scheme: name of the FP8 scale scheme ("none" for 16-bit pools).
        block_size: tokens per block.
        calibration: digest of any calibration data the scheme uses ("" if none).
        compute: the compute dtype name when it is not the one ``auto`` picks (``--dtype``/``KVCHAT_DTYPE``
            override: K/V computed in another dtype differ in their last bits); "" for ``auto``'s, so it
            enters the hashed document only then and every fingerprint made before the override existed
            stays the same.
        weights: :func:`weight_scheme` of the weight format ("" for fp32: then the document, and so the
            fingerprint, is exactly what it was before weight formats existed).
    """
    doc = {
        "model": model_fingerprint,
        "kv_dtype": kv_dtype,
        "scale_scheme": scale_scheme,
        "calibration": calibration,
        "block_size": block_size,
        "layout": LAYOUT_VERSION,
        "numerics": NUMERICS_VERSION,
    }
    if compute:
        doc["compute"] = compute
    if weights:
        doc["weights"] = weights
    blob = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(blob, digest_size=16).hexdigest()


def fp8_scheme_name(k_centring: bool, exact_sink: bool) -> str:
    """Name of an fp8 scheme: the kernels' per-token, per-KV-head scales (``pth1``), then ``+kc`` (K centred,
    :mod:`kvchat.engine.calibration`) and ``+sink`` (position 0 read exact, :meth:`kvchat.engine.runner.Engine.sink_kv`)."""
    from kvchat.kernels.reference import SCALE_SCHEME

    return SCALE_SCHEME + ("+kc" if k_centring else "") + ("+sink" if exact_sink else "")


@dataclass(frozen=True, slots=True)
class CacheIdentity:
    """What shapes one engine's stored K/V bytes; its :attr:`fingerprint` keys every block and snapshot.

    Attributes:
        model_fingerprint: weights + tokenizer + chat template + RoPE (see kvchat.model.fingerprint).
        kv_dtype: ``fp8|bf16|fp16``.
        block_size: tokens per block.
        weight_format: a :data:`WEIGHT_FORMATS` name.
        compute: an overridden compute dtype's name (:func:`compute_key`; None: the one ``auto`` picks).
        int8_kernel: the int8 engine's kernel (see :func:`weight_scheme`; None: this process's).
        compiled_layers: short chunks run the compiled decoder layers (see :func:`weight_scheme`).
        int8_prefill: longer chunks run int8 activations on the integer kernel (see :func:`weight_scheme`).
        calibration_digest: the fp8 K centring's calibration digest (None: not centred); fp8 only.
        exact_sink: position 0 read exact (:meth:`kvchat.engine.runner.Engine.sink_kv`); fp8 only.
    """

    model_fingerprint: str
    kv_dtype: str
    block_size: int = BLOCK_SIZE
    weight_format: str = "fp32"
    compute: str | None = None
    int8_kernel: str | None = None
    compiled_layers: bool = False
    calibration_digest: str | None = None
    exact_sink: bool = False
    int8_prefill: bool = False

    @property
    def scale_scheme(self) -> str:
        """The fp8 scale scheme's name (:func:`fp8_scheme_name`), ``none`` for a 16-bit pool."""
        if self.kv_dtype != "fp8":
            return "none"
        return fp8_scheme_name(self.calibration_digest is not None, self.exact_sink)

    @property
    def fingerprint(self) -> str:
        """The cache fingerprint (:func:`cache_fingerprint`), hex."""
        weights = weight_scheme(self.weight_format, self.int8_kernel, self.compiled_layers, self.int8_prefill)
        calibration = (self.calibration_digest or "") if self.kv_dtype == "fp8" else ""
        return cache_fingerprint(self.model_fingerprint, self.kv_dtype, self.scale_scheme, self.block_size,
                                 calibration, compute=self.compute or "", weights=weights)


def fingerprint_variants(model_fingerprint: str, kv_dtype: str, block_size: int,
                         weight_formats: tuple[str, ...] = WEIGHT_FORMATS,
                         computes: tuple[str | None, ...] | None = None,
                         int8_kernels: tuple[str, ...] | None = None,
                         int8_prefills: tuple[bool, ...] = (False, True)) -> set[str]:
    """Every cache fingerprint an engine of this model and KV dtype may have used (each fp8 scheme variant,
    each int8 kernel of ``int8_kernels``, None: every :data:`kvchat.model.int8_scheme.SMALL_ROWS_KERNELS`,
    with the compiled kernel each ``int8_prefills`` choice),
    with any of ``weight_formats`` and, for each, any of ``computes`` (:func:`compute_key` values; None:
    every one the format allows, :func:`compute_keys`)."""
    from kvchat.model.int8_scheme import SMALL_ROWS_KERNELS

    pairs = [(weight_scheme(w, kernel, layers, prefill), c or "") for w in weight_formats
             for kernel in ((int8_kernels or SMALL_ROWS_KERNELS) if w == "int8" else (None,))
             for layers in ((False, True) if kernel == "avx2" or w == "int4" else (False,))
             for prefill in (int8_prefills if kernel == "avx2" else (False,))
             for c in (compute_keys(w) if computes is None else computes)]
    if kv_dtype != "fp8":
        return {cache_fingerprint(model_fingerprint, kv_dtype, "none", block_size, compute=c, weights=w)
                for w, c in pairs}
    from kvchat.engine.calibration import stored_digest

    digest = stored_digest(model_fingerprint)
    return {cache_fingerprint(model_fingerprint, "fp8", fp8_scheme_name(kc, sink), block_size, digest if kc else "",
                              compute=c, weights=w)
            for kc in ({False, True} if digest else {False}) for sink in (False, True) for w, c in pairs}


def expected_identity(model_fingerprint: str, kv_dtype: str, device=None, weights: str | None = None, *,
                      num_params: int) -> CacheIdentity:
    """The :class:`CacheIdentity` :func:`kvchat.runtime.load_runtime`'s engine gets, without loading the model.

    ``device``: a torch device or its name (None: ``KVCHAT_DEVICE``); ``weights``: ``auto|fp32|bf16|int8|int4``
    (None: ``KVCHAT_WEIGHTS``), ``auto`` resolved for the model's ``num_params`` (its stored parameters); the
    compute dtype is ``KVCHAT_DTYPE``'s (which ``--dtype`` sets). For fp8: K centring when the model's
    calibration is stored, and the exact sink, which every attention backend reads (PyTorch and Triton,
    CPU and GPU alike). int8 or int4 on a CPU: the compiled decoder layers where they build and ``KVCHAT_ATTENTION``
    is unset (as the engine's :func:`kvchat.model.compiled_decode.compiled_decode`; a model they refuse, with
    per-head q/k norms, is named as if they ran: its chats are then reported with no chain).

    Raises:
        kvchat.settings.SettingError: ``device`` is None and ``KVCHAT_DEVICE`` is bad, or (``weights`` None)
            ``KVCHAT_WEIGHTS`` is, or ``KVCHAT_DTYPE`` is.
        ValueError: see :func:`resolve_weight_format`.
    """
    import torch

    from kvchat import settings
    from kvchat.engine.calibration import stored_digest

    dev = torch.device(device) if device is not None else settings.device()
    dtype = settings.compute_dtype()
    fmt = resolve_weight_format(weights or settings.weights(), dev.type, dtype, num_params=num_params)
    layers = prefill = False
    if fmt in CPU_ONLY_FORMATS and dev.type == "cpu" and not settings.attention():
        from kvchat.kernels import cpu_decode

        layers = cpu_decode.available()
    if fmt == "int8" and dev.type == "cpu":
        from kvchat.kernels.cpu_int8 import small_rows_kernel

        prefill = int8_prefill_enabled(settings.int8_prefill(), small_rows_kernel())
    fp8 = kv_dtype == "fp8"
    return CacheIdentity(model_fingerprint, kv_dtype, BLOCK_SIZE, fmt, compute_key(fmt, dtype),
                         compiled_layers=layers, calibration_digest=stored_digest(model_fingerprint) if fp8 else None,
                         exact_sink=fp8, int8_prefill=prefill)
