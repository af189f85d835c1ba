"""The int8 weight scheme's parameters and names (torch-free: the cache fingerprint imports it).

How they were chosen is in :mod:`kvchat.model.quant`'s module doc. Any change
here changes the K/V an int8 engine computes, so it changes a name that
enters the cache fingerprint (:func:`kvchat.engine.cache_identity.weight_scheme`).
"""

INT8_VERSION = 1
INT8MM_MAX_ROWS = 256  # rows up to which the int8 kernel beats dequantize + fp32 GEMM
# rows up to which the compiled kernel runs the groups scheme, then dequantize + fp32 GEMM (the 121 matmuls of a
# SmolLM2 step, 2 threads: 72 vs 107 ms at 16 rows, 262 vs 218 ms at 64)
GROUPS_KERNEL_MAX_ROWS = 32
# chunks of up to this many tokens after position 0 run the compiled decoder layers where an engine has them
# (kvchat.model.compiled_decode: a question after a resume reads the fp8 pool instead of a dense float32 copy
# restored beside it), cold or resumed alike; their K/V differ from the torch layers' in the last bits, so an
# engine with the layers enters the fingerprint with this number (int8_compute_scheme's ``layers``). No more than
# GROUPS_KERNEL_MAX_ROWS, for speed: the layers' matmuls are that kernel's, which past it loses to the fp32 GEMM.
COMPILED_LAYER_MAX_TOKENS = 32
# the compiled layers' attention rounding, named with them: 2 is one pass per 128-token range with the online
# softmax's rescaling (kernels/cpu_attention.c); 1 (unnamed) was scores, softmax and values as three passes
COMPILED_LAYER_VERSION = 2
assert COMPILED_LAYER_MAX_TOKENS <= GROUPS_KERNEL_MAX_ROWS
GROUP_SIZES = {"down_proj": 256}  # per-channel scheme: input columns per scale, by layer name; others: the whole row
# how the weights are quantized (the stored int8 tensors' metadata): per channel for torch's kernel; asymmetric
# groups of 32 for the compiled one (kvchat.kernels.cpu_int8)
INT8_SCHEME = f"int8-v{INT8_VERSION}-per-channel-" + "-".join(f"{k}{v}" for k, v in sorted(GROUP_SIZES.items()))
INT8_GROUPS_VERSION = 1
INT8_GROUPS_SCHEME = f"int8-affine-g32-v{INT8_GROUPS_VERSION}"
# prefill chunks (more than GROUPS_KERNEL_MAX_ROWS rows) with int8 activations, per 32 inputs, on the integer
# kernel (kvchat.kernels.cpu_int8_int8), where an engine's plan runs it: named in the fingerprint with this version
INT8_PREFILL_VERSION = 1
DEFAULT_INT8_PREFILL = "float"  # what KVCHAT_INT8_PREFILL=auto runs (docs/performance.md has the measurements)
SMALL_ROWS_KERNELS = ("int8mm", "avx2")  # torch's bf16-activation int8 kernel; the compiled fp32 one


def int8_compute_scheme(small_rows_kernel: str, layers: bool = False, prefill: bool = False) -> str:
    """The name an int8 engine enters the cache fingerprint with: the quantization and the kernel of each row count
    (``avx2``: the groups scheme on the compiled kernel; ``int8mm``: per channel on torch's), and with ``layers``
    (``avx2`` only) that chunks of up to :data:`COMPILED_LAYER_MAX_TOKENS` tokens run the compiled decoder layers
    (their attention's :data:`COMPILED_LAYER_VERSION` named with it), and with ``prefill`` (``avx2`` only) that
    longer chunks run int8 activations on the integer kernel (:data:`INT8_PREFILL_VERSION`).

    ``small_rows_kernel``: a :data:`SMALL_ROWS_KERNELS` name. ``int8mm`` gives the name int8 caches had before the
    compiled kernel existed, so they stay valid where it is not built; ``avx2`` without ``layers`` the name of
    caches made before the compiled layers ran chunks (and where they do not: ``KVCHAT_ATTENTION=torch``, a model
    they do not take).

    Raises:
        ValueError: an unknown kernel name.
    """
    if small_rows_kernel not in SMALL_ROWS_KERNELS:
        raise ValueError(f"unknown int8 kernel {small_rows_kernel!r}; use {', '.join(SMALL_ROWS_KERNELS)}")
    if small_rows_kernel == "avx2":  # a layer whose inputs do not split into 32s keeps torch's kernel: -mm too
        return (f"{INT8_GROUPS_SCHEME}-avx2f32x{GROUPS_KERNEL_MAX_ROWS}-mm{INT8MM_MAX_ROWS}"
                + (f"-layer{COMPILED_LAYER_MAX_TOKENS}v{COMPILED_LAYER_VERSION}" if layers else "")
                + (f"-prefill-a8g32v{INT8_PREFILL_VERSION}" if prefill else ""))
    return f"{INT8_SCHEME}-mm{INT8MM_MAX_ROWS}"


def stored_scheme(small_rows_kernel: str) -> str:
    """The quantization an engine with ``small_rows_kernel`` stores and reads (:data:`INT8_GROUPS_SCHEME` for
    ``avx2``, :data:`INT8_SCHEME` for ``int8mm``): each has a file of its own beside the model."""
    return INT8_GROUPS_SCHEME if small_rows_kernel == "avx2" else INT8_SCHEME
