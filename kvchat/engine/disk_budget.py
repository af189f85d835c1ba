"""The snapshot disk budget: how many bytes of KV chunks kvchat may keep, enforcing it, and saying so.

The default budget is fixed by the filesystem, not by the cache: 20 % of what everything else leaves
(free space + the cache's own bytes: a chunk written moves its bytes from one to the other), and never
into the disk's free floor (:func:`free_floor`, so the index rows, SQLite's WAL and ``kvchat cache purge``
keep room). The cache's growth cannot raise it, and the snapshot writer makes room (or stops the
snapshot) before a chunk would cross the budget or the floor (:func:`make_room`).

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
from kvchat.units import size_text

FREE_FRACTION = 0.20
CAP_BYTES = 50 * 10**9
FLOOR_FRACTION = 0.05  # of the filesystem, left free by snapshots
FLOOR_BYTES = 10**9  # at least this much left free ...
SMALL_FLOOR_FRACTION = 0.10  # ... but never more than this share of a filesystem under 10 GB (a 40 MB tmpfs keeps 4 MB)
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


def free_floor(total: int) -> int:
    """Bytes of a filesystem of ``total`` bytes that KV snapshots leave free: max(5 %, 1 GB), at most 10 %.

    5 % of a 1 TB disk is 50 GB, of a 100 GB disk 5 GB; a 10 GB disk keeps 1 GB, a smaller one 10 % of itself.
    """
    return max(int(FLOOR_FRACTION * total), min(FLOOR_BYTES, int(SMALL_FLOOR_FRACTION * total)))


def default_budget(total: int, free: int, cache: int) -> int:
    """The default budget, bytes, on a filesystem of ``total`` bytes with ``free`` free while the cache holds ``cache``.

    ``free + cache`` is the filesystem less what everything else uses: writing or evicting chunks
    leaves it unchanged, so the budget does not move as the cache grows. Of it, 20 %, at most 50 GB,
    and never more than leaves :func:`free_floor` free (0 when others use the floor).
    """
    available = free + cache
    return max(0, min(CAP_BYTES, int(FREE_FRACTION * available), available - free_floor(total)))


def budget_bytes(db: Database) -> int:
    """``KVCHAT_CACHE_BUDGET_GB`` if set, else :func:`default_budget` of the data dir's filesystem.

    Raises:
        kvchat.settings.SettingError: the variable is set but not a positive number (decimal GB).
    """
    gb = cache_budget_gb()
    if gb is not None:
        return int(gb * 10**9)
    disk = shutil.disk_usage(data_dir())
    return default_budget(disk.total, disk.free, totals(db).bytes)


def make_room(db: Database, nbytes: int, keep: set[str]) -> tuple[Eviction, str | None]:
    """Before writing a chunk of ``nbytes``: evict least-recently-used unpinned leaf chunks (none of ``keep``,
    the chain being written) until it fits the budget and leaves the disk's free floor free.

    Returns:
        (what was evicted, None) when the chunk fits now; else (what was evicted, why it does not fit):
        the chunk must not be written.

    Raises:
        kvchat.settings.SettingError: see :func:`budget_bytes`.
    """
    budget, cache = budget_bytes(db), totals(db).bytes
    disk = shutil.disk_usage(data_dir())
    floor = free_floor(disk.total)
    over = max(cache + nbytes - budget, floor - (disk.free - nbytes))
    if over <= 0:
        return Eviction(budget_bytes=budget, budget_gb=cache_budget_gb()), None
    rows = evict_to_budget(db, cache - over, keep=keep)
    evicted = Eviction(len(rows), sum(r.bytes for r in rows), budget, cache_budget_gb())
    if evicted.bytes >= over:
        return evicted, None
    if cache + nbytes - evicted.bytes > budget:
        return evicted, f"the disk budget ({size_text(budget)}) has only pinned chunks and this snapshot's own left"
    return evicted, f"the disk keeps {size_text(floor)} free ({size_text(disk.free)} free now)"


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
        budget = f"the default budget of {size_text(eviction.budget_bytes)} (set {CACHE_BUDGET_GB} to change it)"
    return f"evicted {eviction.chunks} chunks ({size_text(eviction.bytes)}) to fit {budget}"


def refresh_pins(db: Database) -> None:
    """Pin exactly the chunks used by pinned chats and documents (pins are per chunk, owners may share chunks)."""
    ancestors = with_ancestors(db, pinned_owner_keys(db))  # a pinned tail keeps its whole chain
    all_keys = [r.key for r in list_chunks(db)]
    set_pinned(db, [k for k in all_keys if k not in ancestors], False)
    set_pinned(db, list(ancestors), True)
