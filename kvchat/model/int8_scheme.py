"""The int8 weight scheme's parameters and name (torch-free: the cache fingerprint imports it).

How they were chosen is in :mod:`kvchat.model.quant`'s module doc. Any change
here changes the K/V an int8 engine computes, so it changes the name, which
enters the cache fingerprint (:func:`kvchat.engine.cache_identity.weight_scheme`).
"""

INT8_VERSION = 1
INT8MM_MAX_ROWS = 256  # rows up to which the int8 kernel beats dequantize + fp32 GEMM
GROUP_SIZES = {"down_proj": 256}  # input columns per scale, by layer name; others: the whole row
INT8_SCHEME = (f"int8-v{INT8_VERSION}-per-channel-" + "-".join(f"{k}{v}" for k, v in sorted(GROUP_SIZES.items()))
               + f"-mm{INT8MM_MAX_ROWS}")
