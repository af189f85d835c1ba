"""Where a chat's or a document's KV lives, and why stored KV was not used (SQLite facts, no torch).

A snapshot counts as "on disk" only under the running engine's cache
fingerprint: chunks written with another KV dtype or model are never
restored, so a chat whose only snapshots are such chunks is shown as
``none`` and its miss is explained by :func:`why_not_restored`.
"""

from __future__ import annotations

from sqlite_utils import Database

from kvchat.cache_id import cache_fingerprint
from kvchat.kv_cache import fp8_scheme_name
from kvchat.tui.backend import CacheState

KV_DTYPES = ("fp8", "bf16", "fp16")


def disk_bytes(db: Database, fingerprint: str | None = None) -> dict[str, int]:
    """Snapshot bytes referenced by each owner (chat ``c_…`` or document ``d_…``).

    With ``fingerprint``, only chunks stored under that cache fingerprint count.
    """
    where, args = ("WHERE k.fingerprint = ?", [fingerprint]) if fingerprint else ("", [])
    rows = db.query("SELECT r.owner, sum(k.bytes) AS b FROM chunk_refs r JOIN kv_chunks k ON k.key = r.key"
                    f" {where} GROUP BY r.owner", args)
    return {r["owner"]: r["b"] for r in rows}


def all_in_memory(cached_tokens: int, history_tokens: int, block_size: int) -> bool:
    """True when the pool holds every full block of the history (the last token is always recomputed).

    A shared prefix alone (the system prompt's blocks, cached for another
    chat) does not make a chat "in memory".
    """
    needed = (history_tokens - 1) // block_size * block_size
    return cached_tokens > 0 and cached_tokens >= needed


def state(in_memory: bool, disk: int) -> CacheState:
    """``memory`` beats ``disk`` beats ``none``."""
    return "memory" if in_memory else "disk" if disk else "none"


def _fingerprints(model_fingerprint: str, kv_dtype: str, block_size: int) -> set[str]:
    """Every cache fingerprint an engine of this model and KV dtype may have used (each fp8 scheme variant)."""
    if kv_dtype != "fp8":
        return {cache_fingerprint(model_fingerprint, kv_dtype, "none", block_size)}
    from kvchat.kv_calibration import stored_digest

    digest = stored_digest(model_fingerprint)
    return {cache_fingerprint(model_fingerprint, "fp8", fp8_scheme_name(kc, sink), block_size, digest if kc else "")
            for kc in ({False, True} if digest else {False}) for sink in (False, True)}


def why_not_restored(db: Database, owner: str, fingerprint: str, model_fingerprint: str, kv_dtype: str,
                     block_size: int) -> str:
    """One line saying why ``owner``'s stored KV could not be restored by an engine with ``fingerprint``.

    Args:
        owner: the chat (or document) id whose chunk references are examined.
        fingerprint: the running engine's cache fingerprint.
        model_fingerprint: the running model's fingerprint (to name another KV dtype).
        kv_dtype: the running engine's KV dtype.
        block_size: the running engine's block size.
    """
    rows = db.query("SELECT k.fingerprint AS fp FROM chunk_refs r JOIN kv_chunks k ON k.key = r.key"
                    " WHERE r.owner = ? GROUP BY k.fingerprint", [owner])
    stored = {r["fp"] for r in rows}
    if not stored:
        return "no KV snapshot on disk (never saved, purged or evicted)"
    if fingerprint in stored:
        return "its snapshot chain stops early (chunks evicted or dropped as corrupt)"
    for other in KV_DTYPES:
        if other != kv_dtype and _fingerprints(model_fingerprint, other, block_size) & stored:
            return f"its KV was saved as {other}; this run uses {kv_dtype} (caches never cross KV dtypes)"
    return "its KV was saved under another cache fingerprint (another model, scale scheme or kvchat version)"
