"""The int4 weight scheme's names (torch-free: the cache fingerprint imports it).

4-bit values in asymmetric groups of 32 inputs with an fp16 scale and minimum each (GGUF's Q4_1 block;
:func:`kvchat.model.quant.quantize_int4_groups`), stored as :data:`INT4_SCHEME`, and run at every row count by the
compiled kernels with the activations quantized to int8 per group of 32 on integer dot products
(:data:`INT4_COMPUTE`, :mod:`kvchat.kernels.cpu_int4`, llama.cpp's Q8_1 block): its group kernel up to
:data:`kvchat.model.int8_scheme.GROUPS_KERNEL_MAX_ROWS` rows, its channel-lanes kernel above
(:class:`kvchat.model.quant.Int4GroupLinear`), and in the compiled decoder layers the channel-lanes kernel for
chunks of :data:`INT4_LANE_MIN_TOKENS` tokens or more. A change to the quantizer changes :data:`INT4_VERSION`
(the stored file and the fingerprint); a change to the kernel's rounding changes :data:`INT4_COMPUTE` (the
fingerprint alone): either changes the K/V an int4 engine computes.
"""

from kvchat.model.int8_scheme import COMPILED_LAYER_MAX_TOKENS, COMPILED_LAYER_VERSION, GROUPS_KERNEL_MAX_ROWS

INT4_VERSION = 1
# how the weights are quantized: the stored file's metadata (its own file beside the model) and the fingerprint's;
# head8: the LM head in the int8 groups scheme (kvchat.model.quant.layer_kind says why)
INT4_SCHEME = f"int4-affine-g32-f16-head8-v{INT4_VERSION}"
# the channel-lanes kernel's float order (kernels/cpu_int4.c)
INT4_LANES_VERSION = 1
# how the int4 layers compute: int8 activations per group of 32 on integer dot products, the group kernel up to
# GROUPS_KERNEL_MAX_ROWS rows, the channel-lanes kernel above
INT4_COMPUTE = f"a8g32x{GROUPS_KERNEL_MAX_ROWS}-lanesv{INT4_LANES_VERSION}"
# the compiled decoder layers run a chunk of this many tokens or more on the channel-lanes kernel, decode steps and
# shorter chunks on the group kernel (kernels/cpu_kernels.h's INT4_LANE_MIN_TOKENS, the same number): from 5 rows
# the lanes kernel is the faster (the 0.8B shape's 64 layer matmuls, weights from memory, 2 threads: 4 rows group
# 34.3 ms, lanes 36.5; 6 rows 47.1 and 41.3; 15 rows 115.0 and 61.8; docs/performance.md)
INT4_LANE_MIN_TOKENS = 5


def int4_compute_scheme(layers: bool = False) -> str:
    """The name an int4 engine enters the cache fingerprint with: the quantization, the kernel's arithmetic
    (:data:`INT4_COMPUTE`), and with ``layers`` that chunks of up to
    :data:`kvchat.model.int8_scheme.COMPILED_LAYER_MAX_TOKENS` tokens run the compiled decoder layers (their
    attention's version named with it), as :func:`kvchat.model.int8_scheme.int8_compute_scheme` names int8's,
    those of :data:`INT4_LANE_MIN_TOKENS` tokens or more on the channel-lanes kernel."""
    return (f"{INT4_SCHEME}-{INT4_COMPUTE}"
            + (f"-layer{COMPILED_LAYER_MAX_TOKENS}v{COMPILED_LAYER_VERSION}-lanes{INT4_LANE_MIN_TOKENS}" if layers else ""))
