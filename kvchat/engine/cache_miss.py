"""Why a chat's stored KV could not be restored by the running engine (SQLite facts, no torch).

Used by ``kvchat ask --chat`` (the ``miss_reason`` of its JSON) and by the TUI.
"""

from __future__ import annotations

from sqlite_utils import Database

from kvchat.engine.cache_identity import (
    FORMAT_COMPUTE,
    KV_DTYPE_NAMES,
    WEIGHT_FORMATS,
    CacheIdentity,
    compute_keys,
    fingerprint_variants,
)
from kvchat.store.chunk_refs import owner_fingerprints

# each int8 kernel (kvchat.model.int8_scheme.SMALL_ROWS_KERNELS): its name, and what makes a run use it
INT8_KERNELS = {"avx2": ("the compiled int8 kernel", "KVCHAT_CPU_KERNEL=1 and a C compiler restore it"),
                "int8mm": ("torch's int8 kernel", "KVCHAT_CPU_KERNEL=0 restores it")}


def why_not_restored(db: Database, owner: str, identity: CacheIdentity) -> str:
    """One line saying why ``owner``'s stored KV (a chat or document id's chunk references) could not be
    restored by an engine of ``identity`` (its fingerprint, model, KV dtype, block size, weight format,
    compute key and int8 kernel name the cause).

    Where part of the chain is stored under ``identity``'s fingerprint and the rest under another, the
    chain stops where it meets turns stored under the other (earlier or later), and the line names what differs (the
    weight format, KV dtype, compute dtype or int8 kernel) as it does for a chat stored wholly under it.
    """
    stored = set(owner_fingerprints(db, owner))
    if not stored:
        return "no KV snapshot on disk (never saved, purged or evicted)"
    if identity.fingerprint not in stored:
        return "its KV " + (_other_identity(stored, identity) or
                            "was saved under another cache fingerprint (another model, scale scheme or kvchat version)")
    others = stored - {identity.fingerprint}
    cause = _other_identity(others, identity) if others else None
    if cause is not None:
        return f"its snapshot chain stops early: other turns' KV {cause}"
    if others:
        return ("its snapshot chain stops early (chunks evicted or dropped as corrupt, or later turns stored "
                "under another model, scale scheme or kvchat version)")
    return "its snapshot chain stops early (chunks evicted or dropped as corrupt)"


def _other_identity(stored: set[str], identity: CacheIdentity) -> str | None:
    """What of ``identity`` differs from the engine that stored ``stored`` (cache fingerprints, none of them
    ``identity``'s), as the rest of a sentence whose subject is the stored KV ("was saved as bf16; this run
    uses fp8 (…)"); None when no KV dtype, int8 kernel, prefill activation, weight format or compute
    dtype of this model accounts for them."""
    model_fingerprint, kv_dtype = identity.model_fingerprint, identity.kv_dtype
    block_size, weight_format, compute = identity.block_size, identity.weight_format, identity.compute
    int8_kernel = identity.int8_kernel
    for other in KV_DTYPE_NAMES:
        if other != kv_dtype and fingerprint_variants(model_fingerprint, other, block_size) & stored:
            return f"was saved as {other}; this run uses {kv_dtype} (caches never cross KV dtypes)"
    for kernel, (name, restore) in INT8_KERNELS.items():
        if weight_format == "int8" and int8_kernel not in (None, kernel) and fingerprint_variants(
                model_fingerprint, kv_dtype, block_size, ("int8",), (compute,), (kernel,)) & stored:
            return f"was computed with {name}; this run uses {INT8_KERNELS[int8_kernel][0]} ({restore})"
    if weight_format == "int8" and int8_kernel == "avx2" and fingerprint_variants(
            model_fingerprint, kv_dtype, block_size, ("int8",), (compute,), ("avx2",), (not identity.int8_prefill,)) & stored:
        was, now = ("float", "int8") if identity.int8_prefill else ("int8", "float")
        return (f"was computed with {was} activations in prefill; this run uses {now} "
                f"(KVCHAT_INT8_PREFILL={was} restores it)")
    for w, c in ((w, c) for w in WEIGHT_FORMATS for c in compute_keys(w)):
        if (w, c) == (weight_format, compute) or not (
                fingerprint_variants(model_fingerprint, kv_dtype, block_size, (w,), (c,)) & stored):
            continue
        was, now = c or FORMAT_COMPUTE[w], compute or FORMAT_COMPUTE[weight_format]
        if w == weight_format:
            return f"was computed in {was}; this run computes in {now} (--dtype {was} restores it)"
        if was == now and c == compute:
            return f"was saved with {w} weights; this run uses {weight_format} (--weights {w} restores it)"
        return (f"was saved with {w} weights computed in {was}; this run uses {weight_format} weights "
                f"computed in {now} (--weights {w} --dtype {was} restores it)")
    return None


def shortfall_reason(db: Database, owner: str, history_tokens: int, reused_tokens: int,
                     identity: CacheIdentity) -> str | None:
    """Why reopening ``owner`` recomputed stored history, or None when it did not.

    A resume from the pool alone stops at the last whole block, cut back to a
    chunk edge, and the files give the rest (the whole history when it is
    stored); a shortfall of a block or more (``history_tokens - 1 -
    reused_tokens >= block_size``) means stored KV was missing or unusable, and :func:`why_not_restored` names why.
    Call it before the new turn's snapshot adds references.
    """
    if history_tokens - 1 - reused_tokens < identity.block_size:
        return None
    return why_not_restored(db, owner, identity)
