"""The snapshot disk budget: how many bytes of KV chunks kvchat may keep, enforcing it, and saying so.

An enforcement that evicts more than a few chunks is worth one line to the
user (a lowered ``KVCHAT_CACHE_BUDGET_GB`` can drop every chat's cache at
once): :func:`enforce` returns an :class:`Eviction` and :func:`eviction_note`
words it; the caller prints the note.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass

from sqlite_utils import Database

from kvchat.paths import data_dir
from kvchat.settings import CACHE_BUDGET_GB, cache_budget_gb
from kvchat.store.chunk_index import evict_to_budget, list_chunks, set_pinned, totals, with_ancestors
from kvchat.store.chunk_refs import pinned_owner_keys

FREE_FRACTION = 0.20
CAP_BYTES = 50 * 10**9
NOTE_MIN_CHUNKS = 5  # evicting fewer chunks is routine LRU churn, not worth a note


@dataclass(slots=True)
class Eviction:
    """What enforcing the budget removed.

    Attributes:
        chunks: chunk files evicted.
        bytes: their size, bytes.
        budget_bytes: the budget enforced, bytes.
        budget_gb: the ``KVCHAT_CACHE_BUDGET_GB`` that set it; None for the default budget.
    """

    chunks: int = 0
    bytes: int = 0
    budget_bytes: int = 0
    budget_gb: float | None = None

    def then(self, later: Eviction) -> Eviction:
        """This eviction followed by ``later``: counts summed, ``later``'s budget (to say several once)."""
        return Eviction(self.chunks + later.chunks, self.bytes + later.bytes, later.budget_bytes, later.budget_gb)


def budget_bytes(db: Database) -> int:
    """``KVCHAT_CACHE_BUDGET_GB`` if set, else 20% of free disk plus what the cache already uses, capped at 50 GB.

    Raises:
        kvchat.settings.SettingError: the variable is set but not a positive number (decimal GB).
    """
    gb = cache_budget_gb()
    if gb is not None:
        return int(gb * 10**9)
    free = shutil.disk_usage(data_dir()).free
    return min(CAP_BYTES, int(FREE_FRACTION * free) + totals(db).bytes)


def enforce(db: Database) -> Eviction:
    """Evict least-recently-used unpinned leaf chunks until the cache fits the budget; say what went.

    Raises:
        kvchat.settings.SettingError: see :func:`budget_bytes`.
    """
    budget = budget_bytes(db)
    rows = evict_to_budget(db, budget)
    return Eviction(len(rows), sum(r.bytes for r in rows), budget, cache_budget_gb())


def eviction_note(eviction: Eviction) -> str | None:
    """One line for the user when ``eviction`` removed at least :data:`NOTE_MIN_CHUNKS` chunks, else None.

    E.g. ``evicted 154 chunks (538.2 MB) to fit KVCHAT_CACHE_BUDGET_GB=0.5``; the
    caller adds its prefix (``kvchat: note: `` on the CLI).
    """
    if eviction.chunks < NOTE_MIN_CHUNKS:
        return None
    if eviction.budget_gb is not None:
        budget = f"{CACHE_BUDGET_GB}={eviction.budget_gb:.10g}"
    else:
        budget = f"the default budget of {eviction.budget_bytes / 1e9:.1f} GB (set {CACHE_BUDGET_GB} to change it)"
    return f"evicted {eviction.chunks} chunks ({eviction.bytes / 1e6:.1f} MB) to fit {budget}"


def refresh_pins(db: Database) -> None:
    """Pin exactly the chunks used by pinned chats and documents (pins are per chunk, owners may share chunks)."""
    ancestors = with_ancestors(db, pinned_owner_keys(db))  # a pinned tail keeps its whole chain
    all_keys = [r.key for r in list_chunks(db)]
    set_pinned(db, [k for k in all_keys if k not in ancestors], False)
    set_pinned(db, list(ancestors), True)
