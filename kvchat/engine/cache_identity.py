"""Cache identity: what must match for stored K/V to be reused.

Anything that changes the stored numbers is part of the fingerprint, so a
difference always misses (DESIGN.md "Cache identity is a fingerprint").
Bump ``NUMERICS_VERSION`` whenever a runner or kernel fix changes K/V values
(a RoPE fix must not silently restore stale caches).

Every fact of a cache's identity is here, once: the KV dtype names, the
fingerprint's inputs, the fp8 scheme names, what an engine gets
(:func:`engine_identity`), what a model and KV dtype would get without
loading it (:func:`expected_cache_fingerprint`), and every variant a store
may hold (:func:`fingerprint_variants`). Importing this module imports no
torch; the functions that name fp8 schemes do.
"""

from __future__ import annotations

import hashlib
import json

BLOCK_SIZE = 16  # tokens per KV block (vLLM's default)
KV_DTYPE_NAMES = ("fp8", "bf16", "fp16")  # the pool dtypes a cache can be stored in (torch dtypes: kv_pool.KV_DTYPES)
LAYOUT_VERSION = 1
NUMERICS_VERSION = 2  # 2: CPU attention over the dense K/V copy; answers recomputed as prefill chunks


def cache_fingerprint(model_fingerprint: str, kv_dtype: str, scale_scheme: str, block_size: int, calibration: str = "",
                      compute: str = "") -> str:
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
    blob = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(blob, digest_size=16).hexdigest()


def fp8_scheme_name(k_centring: bool, exact_sink: bool) -> str:
    """Name of an fp8 scheme: the kernels' per-token, per-KV-head scales (``pth1``), then ``+kc`` (K centred,
    :mod:`kvchat.engine.calibration`) and ``+sink`` (position 0 read exact, :meth:`kvchat.engine.runner.Engine.sink_kv`)."""
    from kvchat.kernels.reference import SCALE_SCHEME

    return SCALE_SCHEME + ("+kc" if k_centring else "") + ("+sink" if exact_sink else "")


def engine_identity(model_fingerprint: str, kv_dtype: str, calibration_digest: str | None, exact_sink: bool,
                    block_size: int, compute: str | None = None) -> tuple[str, str]:
    """``(scale scheme name, cache fingerprint)`` of an engine; ``calibration_digest``/``exact_sink`` count for fp8 only;
    ``compute``: an overridden compute dtype's name (None: the one ``auto`` picks)."""
    if kv_dtype != "fp8":
        return "none", cache_fingerprint(model_fingerprint, kv_dtype, "none", block_size, compute=compute or "")
    scheme = fp8_scheme_name(calibration_digest is not None, exact_sink)
    return scheme, cache_fingerprint(model_fingerprint, kv_dtype, scheme, block_size, calibration_digest or "",
                                     compute or "")


def fingerprint_variants(model_fingerprint: str, kv_dtype: str, block_size: int) -> set[str]:
    """Every cache fingerprint an engine of this model and KV dtype may have used (each fp8 scheme variant)."""
    if kv_dtype != "fp8":
        return {cache_fingerprint(model_fingerprint, kv_dtype, "none", block_size)}
    from kvchat.engine.calibration import stored_digest

    digest = stored_digest(model_fingerprint)
    return {cache_fingerprint(model_fingerprint, "fp8", fp8_scheme_name(kc, sink), block_size, digest if kc else "")
            for kc in ({False, True} if digest else {False}) for sink in (False, True)}


def expected_cache_fingerprint(model_fingerprint: str, kv_dtype: str) -> str:
    """The cache fingerprint :func:`kvchat.model.loader.load_runtime`'s engine gets, without loading the model.

    For fp8: K centring when the model's calibration is stored, and the exact
    sink, which every attention backend reads (PyTorch and Triton, CPU and
    GPU alike), so the fingerprint does not depend on the device.
    """
    from kvchat.engine.calibration import stored_digest

    if kv_dtype != "fp8":
        return engine_identity(model_fingerprint, kv_dtype, None, False, BLOCK_SIZE)[1]
    return engine_identity(model_fingerprint, "fp8", stored_digest(model_fingerprint), True, BLOCK_SIZE)[1]
