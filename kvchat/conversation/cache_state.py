"""Where a chat's or a document's KV lives, and why stored KV was not used (SQLite facts, no torch).

A snapshot counts as "on disk" only under the running engine's cache
fingerprint: chunks written with another KV dtype or model are never
restored, so a chat whose only snapshots are such chunks is shown as
``none`` and its miss is explained by :func:`kvchat.engine.cache_miss.why_not_restored`.
"""

from __future__ import annotations

from sqlite_utils import Database

from kvchat.conversation.views import CacheState
from kvchat.store.chunk_refs import owner_bytes


def disk_bytes(db: Database, fingerprint: str | None = None) -> dict[str, int]:
    """Snapshot bytes referenced by each owner (chat ``c_…`` or document ``d_…``).

    With ``fingerprint``, only chunks stored under that cache fingerprint count.
    """
    return owner_bytes(db, fingerprint)


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


