"""SQLite connections to the kvchat index (one file: :func:`kvchat.paths.db_path`).

Locking, documented once here (issue: reliability, "two processes on one data dir"):

- WAL journal, so readers never block the writer and a crash at any instant
  leaves the last committed state; ``synchronous=FULL``, so a committed turn
  also survives a power cut.
- Every write runs in :func:`write_transaction` = ``BEGIN IMMEDIATE``: the
  write lock is taken up front, so two writers never deadlock upgrading read
  locks; the other process waits up to ``BUSY_TIMEOUT_MS``.
- The driver runs with ``isolation_level=None``: it never opens implicit
  transactions, so every transaction boundary is in this code.
- A connection belongs to one thread (``check_same_thread``); use
  :func:`get_db` to get the calling thread's own connection.
- Nothing in kvchat opens a descriptor of its own on ``kvchat.db``, ``-wal``
  or ``-shm``: on POSIX, closing any descriptor of a file drops all of the
  process's advisory locks on it, including the shared lock each open WAL
  connection holds; another process would then checkpoint and delete the WAL
  under this one (SQLite, "How To Corrupt An SQLite Database File", §2.2).
  Only SQLite opens them; permissions are set with ``chmod``, sizes read with
  ``stat``, copies made with ``VACUUM INTO``.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

from sqlite_utils import Database

from kvchat.paths import db_path

from .errors import TruncatedDatabaseError
from .migrations import migrate

BUSY_TIMEOUT_MS = 10_000

_local = threading.local()


def connect(path: Path | None = None) -> Database:
    """Open a new connection (default: :func:`kvchat.paths.db_path`) and migrate the schema.

    The file is created with mode 0600. Backups made before migrations go to
    ``<db dir>/backups``.

    Raises:
        TruncatedDatabaseError: the file is empty but ``<db dir>/kv`` holds chunk
            files (a fresh schema would orphan them, and ``cache gc`` delete them).
        SchemaTooNewError, MigrationError: see :func:`kvchat.store.migrations.migrate`.
    """
    path = Path(path) if path is not None else db_path()
    _refuse_truncated(path)
    created = not path.exists()
    conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=True)
    if created:
        # chmod, never open(): closing any descriptor of the file would drop every POSIX lock this
        # process's other connections hold on it (module docstring). The -wal and -shm files SQLite
        # creates later copy the database file's mode.
        os.chmod(path, 0o600)
    db = Database(conn, execute_plugins=False)
    db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    db.enable_wal()
    db.execute("PRAGMA synchronous = FULL")
    db.execute("PRAGMA foreign_keys = ON")
    try:
        migrate(db, path.parent / "backups")
    except BaseException:
        db.close()
        raise
    return db


def _refuse_truncated(path: Path) -> None:
    """Raise :class:`TruncatedDatabaseError` for an empty ``path`` beside stored chunk files.

    kvchat writes its schema before any chunk, so an empty file next to chunks
    is a database that lost its contents, never a new one.
    """
    try:
        empty = path.stat().st_size == 0
    except FileNotFoundError:
        return
    kv = path.parent / "kv"
    if empty and kv.is_dir() and next(kv.rglob("*.safetensors"), None) is not None:
        raise TruncatedDatabaseError(
            f"the database {path} is empty (0 bytes) but KV chunk files exist in {kv}: it was truncated; "
            f"restore it from {path.parent / 'backups'} if one is there, or move it away to start a new index")


def get_db() -> Database:
    """The calling thread's connection to :func:`kvchat.paths.db_path`, opened on first use.

    Keyed by the resolved path, so changing ``$KVCHAT_HOME`` (tests) opens a new one.
    """
    conns: dict[str, Database] = _local.__dict__.setdefault("conns", {})
    key = str(db_path().resolve())
    if key not in conns:
        conns[key] = connect(Path(key))
    return conns[key]


def close_thread_dbs() -> None:
    """Close every connection :func:`get_db` opened for the calling thread."""
    conns: dict[str, Database] = _local.__dict__.pop("conns", {})
    for db in conns.values():
        db.close()


@contextlib.contextmanager
def write_transaction(db: Database) -> Iterator[Database]:
    """``BEGIN IMMEDIATE`` … ``COMMIT``; rolls back if the block raises.

    Nested use becomes a savepoint of the outer transaction. Waits up to
    ``BUSY_TIMEOUT_MS`` for another writer, then raises ``sqlite3.OperationalError``
    ("database is locked").
    """
    if db.conn.in_transaction:
        with db.atomic():
            yield db
        return
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
    except BaseException:
        db.rollback()
        raise
    try:
        db.execute("COMMIT")
    except BaseException:
        db.rollback()
        raise
