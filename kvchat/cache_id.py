"""Cache identity: what must match for stored K/V to be reused.

Anything that changes the stored numbers is part of the fingerprint, so a
difference always misses (DESIGN.md "Cache identity is a fingerprint").
Bump ``NUMERICS_VERSION`` whenever a runner or kernel fix changes K/V values
(a RoPE fix must not silently restore stale caches).
"""

from __future__ import annotations

import hashlib
import json

LAYOUT_VERSION = 1
NUMERICS_VERSION = 2  # 2: CPU attention over the dense K/V copy; answers recomputed as prefill chunks


def cache_fingerprint(model_fingerprint: str, kv_dtype: str, scale_scheme: str, block_size: int, calibration: str = "") -> str:
    """Hex blake2b-128 over the canonical JSON of every input that shapes the K/V bytes.

    Args:
        model_fingerprint: weights + tokenizer + chat template + RoPE (see kvchat.fingerprint).
        kv_dtype: ``fp8|bf16|fp16``.
        scale_scheme: name of the FP8 scale scheme ("none" for 16-bit pools).
        block_size: tokens per block.
        calibration: digest of any calibration data the scheme uses ("" if none).
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
    blob = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(blob, digest_size=16).hexdigest()
