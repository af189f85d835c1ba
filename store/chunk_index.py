"""The ``kv_chunks`` index: which chunk files exist, their chain, LRU, pins, refs, eviction, gc.

Chunk files live in :func:`kv_root` of the database (``kv`` beside ``kvchat.db``). Which owner
(chat or document) uses which chunk is :mod:`kvchat.store.chunk_refs`.

Invariants kept under the SQLite write lock (``BEGIN IMMEDIATE``):
- a file is renamed into place and its row inserted in the same transaction,
  so two processes writing one key agree (the second discards its copy);
- rows and files are deleted together (file unlinked before COMMIT), so no
  writer can publish a file between the two;
- eviction removes only leaves (no row has them as ``parent_key``), oldest
  ``last_used`` first, never pinned ones: a chain is cut only from its end.
A crash can still leave a file without a row (or a temp file): :func:`gc`
removes those once older than the writer window.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from sqlite_utils import Database

from .db import db_file, write_transaction
from .errors import CorruptChunkError
from .faults import crash_point
from .snapshot import ChunkData, ChunkLayout, chunk_relpath, discard_chunk, kv_dir, publish_chunk, stage_chunk
from .snapshot_read import read_chunk, verify_chunk_file

WRITER_WINDOW_S = 600.0


@dataclass(slots=True, frozen=True)
class ChunkRow:
    """One ``kv_chunks`` row. ``file_path`` is relative to ``root`` (:func:`kv_root`); times are Unix s."""

    key: str
    parent_key: str | None
    fingerprint: str
    token_count: int
    file_path: str
    bytes: int
    checksum: str
    created: float
    last_used: float
    pinned: bool
    ref_count: int
    root: Path = field(compare=False, repr=False)  # the chunk files' folder, not a column

    @property
    def path(self) -> Path:
        return self.root / self.file_path


@dataclass(slots=True, frozen=True)
class ChunkTotals:
    count: int
    bytes: int
    pinned_count: int
    pinned_bytes: int


@dataclass(slots=True, frozen=True)
class GcReport:
    files_removed: int
    bytes_freed: int
    rows_removed: int


_COLS = ", ".join(f.name for f in fields(ChunkRow) if f.name != "root")


def kv_root(db: Database) -> Path:
    """The folder of ``db``'s chunk files: :func:`kvchat.store.snapshot.kv_dir` of the folder holding the database."""
    return kv_dir(db_file(db).parent)


def _row(r: dict, root: Path) -> ChunkRow:
    return ChunkRow(**{**r, "pinned": bool(r["pinned"])}, root=root)


def get_chunk(db: Database, key: str) -> ChunkRow | None:
    """The row for ``key``, or None."""
    rows = list(db.query(f"SELECT {_COLS} FROM kv_chunks WHERE key = ?", [key]))
    return _row(rows[0], kv_root(db)) if rows else None


def list_chunks(db: Database, *, fingerprint: str | None = None) -> list[ChunkRow]:
    """All rows (optionally of one cache fingerprint), oldest first."""
    where, params = ("WHERE fingerprint = ?", [fingerprint]) if fingerprint is not None else ("", [])
    root = kv_root(db)
    return [_row(r, root) for r in db.query(f"SELECT {_COLS} FROM kv_chunks {where} ORDER BY created, key", params)]


def list_tails(db: Database, parent_key: str | None, fingerprint: str, shorter_than: int) -> list[ChunkRow]:
    """Chunks of ``fingerprint`` under ``parent_key`` (None: chain starts) with fewer than ``shorter_than``
    tokens (the tails), longest first."""
    root = kv_root(db)
    return [_row(r, root) for r in db.query(
        f"SELECT {_COLS} FROM kv_chunks WHERE parent_key IS ? AND fingerprint = ? AND token_count < ?"
        " ORDER BY token_count DESC",
        [parent_key, fingerprint, shorter_than],
    )]


def existing_keys(db: Database, keys: Iterable[str]) -> set[str]:
    """Those of ``keys`` that have a row."""
    keys = list(keys)
    if not keys:
        return set()
    return {r["key"] for r in db.query(f"SELECT key FROM kv_chunks WHERE key IN ({','.join('?' * len(keys))})", keys)}


def with_ancestors(db: Database, keys: Iterable[str]) -> set[str]:
    """``keys`` and every chunk their chains run through (parents, their parents, ...)."""
    found = set(keys)
    frontier = list(found)
    while frontier:
        rows = db.query(
            f"SELECT parent_key FROM kv_chunks WHERE key IN ({','.join('?' * len(frontier))}) AND parent_key IS NOT NULL",
            frontier,
        )
        frontier = [r["parent_key"] for r in rows if r["parent_key"] not in found]
        found.update(frontier)
    return found


def count_other_fingerprints(db: Database, fingerprint: str) -> int:
    """How many chunks are stored under a cache fingerprint other than ``fingerprint``."""
    return next(iter(db.query("SELECT count(*) AS n FROM kv_chunks WHERE fingerprint != ?", [fingerprint])))["n"]


def add_chunk(db: Database, data: ChunkData, *, key: str, parent_key: str | None, fingerprint: str) -> ChunkRow:
    """Write ``data`` as chunk ``key`` and index it; return the row (the existing one if another writer won).

    The file is written and fsynced outside the lock; the existence check, rename,
    directory fsync and row insert happen in one ``BEGIN IMMEDIATE`` transaction,
    so the row is either absent (insert) or points at a missing file (replaced,
    keeping its pin and ref_count). Raises OSError (e.g. ENOSPC) with nothing left behind.
    """
    staged = stage_chunk(data, key=key, parent_key=parent_key, fingerprint=fingerprint, root=kv_root(db))
    try:
        with write_transaction(db):
            existing = get_chunk(db, key)
            if existing is not None and existing.path.exists():
                return existing
            publish_chunk(staged)
            crash_point("chunk_after_rename")
            now = time.time()
            db.execute(
                "INSERT OR REPLACE INTO kv_chunks (key, parent_key, fingerprint, token_count, file_path, bytes,"
                " checksum, created, last_used, pinned, ref_count) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [key, parent_key, fingerprint, data.token_count, chunk_relpath(key), staged.nbytes, staged.checksum,
                 now, now, int(existing.pinned) if existing else 0, existing.ref_count if existing else 0],
            )
        return get_chunk(db, key)  # type: ignore[return-value]
    finally:
        discard_chunk(staged)


def load_chunk(db: Database, row: ChunkRow, layout: ChunkLayout, *, out: torch.Tensor | None = None,
               touch_row: bool = True) -> ChunkData:
    """Read and verify ``row``'s file against the row and ``layout``; touch it on success.

    ``out``: optional staging buffer, as in :func:`kvchat.store.snapshot_read.read_chunk`.
    ``touch_row=False`` leaves ``last_used`` to the caller (one :func:`touch` for many
    chunks costs one commit instead of one each).

    Raises:
        CorruptChunkError: the file is missing/corrupt; the row and file have been deleted.
    """
    try:
        data = read_row(row, layout, out=out)
    except CorruptChunkError:
        delete_chunk(db, row.key)
        raise
    if touch_row:
        touch(db, [row.key])
    return data


def read_row(row: ChunkRow, layout: ChunkLayout, *, out: torch.Tensor | None = None) -> ChunkData:
    """Read and verify ``row``'s file, touching no database (safe in any thread).

    Raises:
        CorruptChunkError: the file is missing/corrupt (the caller drops the row, see :func:`load_chunk`).
    """
    return read_chunk(row.path, layout, key=row.key, parent_key=row.parent_key, fingerprint=row.fingerprint,
                      token_count=row.token_count, checksum=row.checksum, out=out)


def _delete_locked(db: Database, rows: Iterable[ChunkRow]) -> None:
    for r in rows:
        db.execute("DELETE FROM kv_chunks WHERE key = ?", [r.key])
        r.path.unlink(missing_ok=True)


def delete_chunk(db: Database, key: str) -> bool:
    """Delete the row and file of ``key``; return whether a row existed."""
    with write_transaction(db):
        row = get_chunk(db, key)
        if row is not None:
            _delete_locked(db, [row])
    return row is not None


def touch(db: Database, keys: Iterable[str], *, now: float | None = None) -> None:
    """Set ``last_used`` of ``keys`` to ``now`` (default: current time)."""
    with write_transaction(db):
        stamp = time.time() if now is None else now
        db.conn.executemany("UPDATE kv_chunks SET last_used = ? WHERE key = ?", [(stamp, k) for k in keys])


def set_pinned(db: Database, keys: Iterable[str], pinned: bool) -> None:
    """Pin (exempt from eviction) or unpin ``keys``."""
    with write_transaction(db):
        db.conn.executemany("UPDATE kv_chunks SET pinned = ? WHERE key = ?", [(int(pinned), k) for k in keys])


def ref_chunks(db: Database, keys: Iterable[str]) -> None:
    """Add one reference (a conversation or document using it) to each of ``keys``."""
    with write_transaction(db):
        db.conn.executemany("UPDATE kv_chunks SET ref_count = ref_count + 1 WHERE key = ?", [(k,) for k in keys])


def unref_chunks(db: Database, keys: Iterable[str]) -> list[str]:
    """Drop one reference from each of ``keys``, then delete those left unreferenced; return deleted keys.

    A chunk is deleted when its ref_count is 0, it is not pinned and no remaining
    chunk has it as parent (so a chain still used by someone else stays whole).
    Passes repeat until one deletes nothing, so a whole unshared chain goes at
    once whatever the order of ``keys`` (owners' refs come back in key order, not chain order).
    """
    keys = list(keys)
    deleted: list[str] = []
    root = kv_root(db)
    with write_transaction(db):
        db.conn.executemany("UPDATE kv_chunks SET ref_count = max(ref_count - 1, 0) WHERE key = ?", [(k,) for k in keys])
        pending = list(dict.fromkeys(keys))
        while pending:
            gone = []
            for key in reversed(pending):
                rows = list(db.query(
                    f"SELECT {_COLS} FROM kv_chunks c WHERE key = ? AND ref_count = 0 AND pinned = 0"
                    " AND NOT EXISTS (SELECT 1 FROM kv_chunks ch WHERE ch.parent_key = c.key)",
                    [key],
                ))
                _delete_locked(db, (_row(r, root) for r in rows))
                gone += [r["key"] for r in rows]
            if not gone:
                break
            deleted += gone
            pending = [k for k in pending if k not in gone]
    return deleted


def totals(db: Database) -> ChunkTotals:
    """Count and bytes of all chunks and of pinned ones."""
    r = next(db.query(
        "SELECT count(*) AS count, coalesce(sum(bytes), 0) AS bytes, coalesce(sum(pinned != 0), 0) AS pinned_count,"
        " coalesce(sum(CASE WHEN pinned != 0 THEN bytes ELSE 0 END), 0) AS pinned_bytes FROM kv_chunks"
    ))
    return ChunkTotals(**r)


def evict_to_budget(db: Database, budget_bytes: int, keep: Iterable[str] = ()) -> list[ChunkRow]:
    """Delete least-recently-used unpinned leaf chunks until the total is ≤ ``budget_bytes``; return them.

    Never one of ``keep`` (a chain being written). Stops early (over budget) if only pinned chunks, ``keep``
    or their ancestors are left.
    """
    evicted: list[ChunkRow] = []
    root = kv_root(db)
    keep = list(keep)
    spare = f" AND key NOT IN ({','.join('?' * len(keep))})" if keep else ""
    with write_transaction(db):
        total = totals(db).bytes
        while total > budget_bytes:
            rows = list(db.query(
                f"SELECT {_COLS} FROM kv_chunks c WHERE pinned = 0{spare}"
                " AND NOT EXISTS (SELECT 1 FROM kv_chunks ch WHERE ch.parent_key = c.key)"
                " ORDER BY last_used, created, key LIMIT 1", keep
            ))
            if not rows:
                break
            victim = _row(rows[0], root)
            _delete_locked(db, [victim])
            evicted.append(victim)
            total -= victim.bytes
    return evicted


def gc(db: Database, *, writer_window_s: float = WRITER_WINDOW_S, now: float | None = None) -> GcReport:
    """Remove files no row references (and stale temp files) older than ``writer_window_s``, and rows whose file is gone."""
    now = time.time() if now is None else now
    files = bytes_freed = rows_removed = 0
    with write_transaction(db):
        known = {r["file_path"]: r["key"] for r in db.query("SELECT key, file_path FROM kv_chunks")}
        root = kv_root(db)
        for path in root.glob("*/*") if root.is_dir() else []:
            rel = path.relative_to(root).as_posix()
            if rel in known or not path.is_file():
                continue
            st = path.stat()
            if now - st.st_mtime >= writer_window_s:
                path.unlink(missing_ok=True)
                files += 1
                bytes_freed += st.st_size
        for rel, key in known.items():
            if not (root / rel).exists():
                db.execute("DELETE FROM kv_chunks WHERE key = ?", [key])
                rows_removed += 1
    return GcReport(files, bytes_freed, rows_removed)


def verify_chunks(db: Database, *, drop: bool = True) -> list[CorruptChunkError]:
    """Check every indexed file against its row's checksum; return the failures (dropped if ``drop``)."""
    bad = []
    for row in list_chunks(db):
        try:
            verify_chunk_file(row.path, key=row.key, fingerprint=row.fingerprint, checksum=row.checksum)
        except CorruptChunkError as exc:
            bad.append(exc)
            if drop:
                delete_chunk(db, row.key)
    return bad
