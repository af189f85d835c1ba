"""The snapshot disk budget: how many bytes of KV chunks kvchat may keep, and enforcing it."""

from __future__ import annotations

import math
import os
import shutil

from sqlite_utils import Database

from kvchat.paths import data_dir
from kvchat.store.chunk_index import ChunkRow, evict_to_budget, set_pinned, totals

FREE_FRACTION = 0.20
CAP_BYTES = 50 * 10**9


class BudgetConfigError(ValueError):
    """``KVCHAT_CACHE_BUDGET_GB`` is not a non-negative number."""


def budget_bytes(db: Database) -> int:
    """``KVCHAT_CACHE_BUDGET_GB`` if set, else 20% of free disk plus what the cache already uses, capped at 50 GB.

    Raises:
        BudgetConfigError: the variable is set but not a number >= 0 (decimal GB).
    """
    env = os.environ.get("KVCHAT_CACHE_BUDGET_GB")
    if env:
        try:
            gb = float(env)
        except ValueError:
            gb = -1.0
        if not 0 <= gb < math.inf:  # also rejects nan
            raise BudgetConfigError(f"KVCHAT_CACHE_BUDGET_GB must be a number of gigabytes >= 0, got {env!r}")
        return int(gb * 10**9)
    free = shutil.disk_usage(data_dir()).free
    return min(CAP_BYTES, int(FREE_FRACTION * free) + totals(db).bytes)


def enforce(db: Database) -> list[ChunkRow]:
    """Evict least-recently-used unpinned leaf chunks until the cache fits the budget; returns the evicted rows."""
    return evict_to_budget(db, budget_bytes(db))


def refresh_pins(db: Database) -> None:
    """Pin exactly the chunks used by pinned chats and documents (pins are per chunk, owners may share chunks)."""
    pinned = {r["key"] for r in db.query(
        "SELECT r.key FROM chunk_refs r WHERE r.owner IN (SELECT id FROM conversations WHERE pinned != 0"
        " UNION SELECT id FROM documents WHERE pinned != 0)"
    )}
    ancestors = set(pinned)
    frontier = list(pinned)
    while frontier:  # a pinned tail keeps its whole chain
        rows = db.query(
            f"SELECT parent_key FROM kv_chunks WHERE key IN ({','.join('?' * len(frontier))}) AND parent_key IS NOT NULL",
            frontier,
        )
        frontier = [r["parent_key"] for r in rows if r["parent_key"] not in ancestors]
        ancestors.update(frontier)
    all_keys = [r["key"] for r in db.query("SELECT key FROM kv_chunks")]
    set_pinned(db, [k for k in all_keys if k not in ancestors], False)
    set_pinned(db, list(ancestors), True)
