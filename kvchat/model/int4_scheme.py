"""The int4 weight scheme's name (torch-free: the cache fingerprint imports it).

4-bit values in asymmetric groups of 32 inputs with an fp16 scale and minimum each (GGUF's Q4_1 block;
:func:`kvchat.model.quant.quantize_int4_groups`), run by the compiled kernel :mod:`kvchat.kernels.cpu_int4`
up to :data:`kvchat.model.int8_scheme.GROUPS_KERNEL_MAX_ROWS` rows and as the dequantized weight's fp32 GEMM
above (the int8 groups scheme's split, for the same reason). Any change to the quantizer, the rounding of a
kernel or that split changes the K/V an int4 engine computes, so it changes :data:`INT4_VERSION`.
"""

from kvchat.model.int8_scheme import COMPILED_LAYER_MAX_TOKENS, COMPILED_LAYER_VERSION, GROUPS_KERNEL_MAX_ROWS

INT4_VERSION = 1
# how the weights are quantized: the stored file's metadata (its own file beside the model) and the fingerprint's;
# head8: the LM head in the int8 groups scheme (kvchat.model.quant.layer_kind says why)
INT4_SCHEME = f"int4-affine-g32-f16-head8-v{INT4_VERSION}"


def int4_compute_scheme(layers: bool = False) -> str:
    """The name an int4 engine enters the cache fingerprint with: the quantization, the compiled kernel's row
    limit (fp32 GEMM above), and with ``layers`` that chunks of up to
    :data:`kvchat.model.int8_scheme.COMPILED_LAYER_MAX_TOKENS` tokens run the compiled decoder layers (their
    attention's version named with it), as :func:`kvchat.model.int8_scheme.int8_compute_scheme` names int8's."""
    return (f"{INT4_SCHEME}-avx2f32x{GROUPS_KERNEL_MAX_ROWS}"
            + (f"-layer{COMPILED_LAYER_MAX_TOKENS}v{COMPILED_LAYER_VERSION}" if layers else ""))
