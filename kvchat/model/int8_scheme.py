"""The int8 weight scheme's parameters and names (torch-free: the cache fingerprint imports it).

How they were chosen is in :mod:`kvchat.model.quant`'s module doc. Any change
here changes the K/V an int8 engine computes, so it changes a name that
enters the cache fingerprint (:func:`kvchat.engine.cache_identity.weight_scheme`).
"""

INT8_VERSION = 1
INT8MM_MAX_ROWS = 256  # rows up to which the int8 kernel beats dequantize + fp32 GEMM
# rows up to which the compiled kernel (kvchat.kernels.cpu_int8) runs: the 121 matmuls of a SmolLM2 step, 2 threads,
# at 16 rows 49.9 ms vs 54.6 for the bf16 int8 kernel, at 64 rows 222 vs 187 ms (at 1 row 5.8 vs 17.1)
CPU_KERNEL_MAX_ROWS = 16
GROUP_SIZES = {"down_proj": 256}  # input columns per scale, by layer name; others: the whole row
# how the weights are quantized: the stored int8 tensors' metadata
INT8_SCHEME = f"int8-v{INT8_VERSION}-per-channel-" + "-".join(f"{k}{v}" for k, v in sorted(GROUP_SIZES.items()))
SMALL_ROWS_KERNELS = ("int8mm", "avx2")  # torch's bf16-activation int8 kernel; the compiled fp32 one


def int8_compute_scheme(small_rows_kernel: str) -> str:
    """The name an int8 engine enters the cache fingerprint with: the quantization and the kernel of each row count.

    ``small_rows_kernel``: a :data:`SMALL_ROWS_KERNELS` name. ``int8mm`` gives the name int8 caches had before the
    compiled kernel existed, so they stay valid where it is not built.

    Raises:
        ValueError: an unknown kernel name.
    """
    if small_rows_kernel not in SMALL_ROWS_KERNELS:
        raise ValueError(f"unknown int8 kernel {small_rows_kernel!r}; use {', '.join(SMALL_ROWS_KERNELS)}")
    compiled = f"-avx2f32x{CPU_KERNEL_MAX_ROWS}" if small_rows_kernel == "avx2" else ""
    return f"{INT8_SCHEME}{compiled}-mm{INT8MM_MAX_ROWS}"
