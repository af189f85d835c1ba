"""SQLite connections to the kvchat index (one ``kvchat.db`` per data dir; the caller passes its path).

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
- The store never looks up where the data dir is: callers pass the database
  path, and the KV chunk files live beside it (:func:`db_file`).
- A disk with no room for SQLite's WAL index (the ``-shm``, 32 KiB) would refuse every connection; upkeep
  commands open with ``on_full_disk`` and listings through :func:`connect_reader`: where no other
  connection holds a ``-shm`` and under ``FULL_DISK_BYTES`` are free, they take the database in
  ``locking_mode=EXCLUSIVE`` (SQLite then keeps the WAL index in heap memory, no ``-shm``), and upkeep
  deletes chunk files inside its transactions before they commit, so the WAL's frames find the room.
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
import shutil
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

from sqlite_utils import Database

from .errors import DamagedDatabaseError, ReadOnlyStoreError, TruncatedDatabaseError
from .migrations import check_schema, migrate

BUSY_TIMEOUT_MS = 10_000
SHM_REGION_BYTES = 32 * 2**10  # one region of the WAL index (-shm): a live WAL connection has mapped at least one
FULL_DISK_BYTES = 2**20  # under this much free, a -shm and a transaction's WAL frames may not fit

_local = threading.local()
_checked: set[str] = set()  # databases this process has run quick_check on
_checked_lock = threading.Lock()


def backups_dir(path: Path) -> Path:
    """Where :func:`kvchat.store.migrations.migrate` keeps backups of the database at ``path``."""
    return path.parent / "backups"


def _backups_hint(path: Path) -> str:
    """``"; backups of it are in DIR"`` when that folder holds any, else ``""``."""
    backups = backups_dir(path)
    return f"; backups of it are in {backups}" if backups.is_dir() and any(backups.iterdir()) else ""


def writable(path: Path) -> bool:
    """Whether the folder holding the database at ``path`` can take new files (the -wal, -shm, chunks)."""
    return os.access(path.parent, os.W_OK | os.X_OK)


def require_writable(path: Path) -> None:
    """Refuse, before any work, a command that will store something in a read-only data dir.

    Raises:
        ReadOnlyStoreError: the folder holding the database at ``path`` cannot be written.
    """
    if not writable(path):
        raise ReadOnlyStoreError(f"the data dir {path.parent} is read-only; this command stores its result in "
                                 f"{path}; make the folder writable or set KVCHAT_HOME; nothing was changed")


def no_room_for_wal_index(path: Path) -> bool:
    """Whether no connection has a WAL index (``-shm``) of the database at ``path`` and its disk has under
    ``FULL_DISK_BYTES`` free: a plain connection would fail (``disk I/O error``) creating one."""
    shm = path.with_name(path.name + "-shm")
    try:
        mapped = shm.stat().st_size >= SHM_REGION_BYTES
    except FileNotFoundError:
        mapped = False
    return not mapped and shutil.disk_usage(path.parent).free < FULL_DISK_BYTES


def _exclusive(conn: sqlite3.Connection) -> None:
    """Before the first read: hold the database alone, WAL index in heap memory, temp tables in memory."""
    conn.execute("PRAGMA locking_mode = EXCLUSIVE")
    conn.execute("PRAGMA temp_store = MEMORY")


def connect(path: Path, *, on_full_disk: bool = False) -> Database:
    """Open a new connection to the database file ``path`` and migrate the schema.

    The file is created with mode 0600. Backups made before migrations go to
    :func:`backups_dir`. In a data dir that cannot be written, an existing
    database opens read-only (``immutable`` when it has no -wal: no writer of
    this user can exist where no -wal can be created), so read-only commands still work; a write then
    raises ``sqlite3.OperationalError`` (see :func:`database_error_line`).

    ``on_full_disk``: where :func:`no_room_for_wal_index`, open in ``locking_mode=EXCLUSIVE`` (module
    docstring); other processes then wait for this connection to close. For short upkeep commands only.

    Raises:
        TruncatedDatabaseError: the file is empty but ``<db dir>/kv`` holds chunk
            files (a fresh schema would orphan them, and ``cache gc`` delete them).
        ReadOnlyStoreError: the data dir is read-only and the database is missing or needs a migration.
        DamagedDatabaseError: the first connection of this process finds the file damaged
            (:func:`check_database`, run before any migration or backup).
        SchemaTooNewError, MigrationError: see :func:`kvchat.store.migrations.migrate`.
    """
    path = Path(path)
    _refuse_truncated(path)
    if not writable(path):
        return _connect_read_only(path)
    created = not path.exists()
    conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=True)
    if on_full_disk and not created and no_room_for_wal_index(path):
        _exclusive(conn)
    if created:
        # chmod, never open(): closing any descriptor of the file would drop every POSIX lock this
        # process's other connections hold on it (module docstring). The -wal and -shm files SQLite
        # creates later copy the database file's mode.
        os.chmod(path, 0o600)
    db = Database(conn, execute_plugins=False)
    try:
        db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        _check_once(db, path)  # before anything writes to the file (journal mode, migrations, backups)
        db.enable_wal()
        db.execute("PRAGMA synchronous = FULL")
        db.execute("PRAGMA foreign_keys = ON")
        migrate(db, backups_dir(path))
    except BaseException:
        db.close()
        raise
    return db


def connect_reader(path: Path) -> Database:
    """A connection that only reads the database at ``path`` (listings), also on a full disk.

    ``query_only``, and where :func:`no_room_for_wal_index` in ``locking_mode=EXCLUSIVE``. Not a
    ``mode=ro`` open: that could neither open a full disk's database nor, on closing, remove the ``-wal``
    and ``-shm`` it created. A missing database, or one that needs a migration, is opened by
    :func:`connect` (which creates or migrates it); a read-only data dir as there.

    Raises:
        the errors of :func:`connect`.
    """
    path = Path(path)
    _refuse_truncated(path)
    if not writable(path) or not path.is_file():
        return connect(path)
    conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=True)
    if no_room_for_wal_index(path):
        _exclusive(conn)
    conn.execute("PRAGMA query_only = ON")
    db = Database(conn, execute_plugins=False)
    db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    if _needs_migration(db, path):
        return connect(path)
    return db


def _needs_migration(db: Database, path: Path) -> bool:
    """Check a read-only connection ``db`` to ``path`` (:func:`_check_once`, the schema version); True, with
    ``db`` closed, when the schema needs a migration. A damaged or newer database closes ``db`` and raises."""
    try:
        _check_once(db, path)
        pending = check_schema(db)
    except BaseException:
        db.close()
        raise
    if pending:
        db.close()
    return bool(pending)


def _check_once(db: Database, path: Path) -> None:
    """:func:`check_database` on the first connection this process opens to ``path`` (before any migration)."""
    key = str(path.resolve())
    with _checked_lock:
        if key not in _checked:
            check_database(db, path)
            _checked.add(key)


def _connect_read_only(path: Path) -> Database:
    """A read-only connection to an existing, current database in a read-only data dir."""
    if not path.is_file():
        raise ReadOnlyStoreError(f"the data dir {path.parent} is read-only and holds no database yet; "
                                 "make it writable or set KVCHAT_HOME to a writable folder")
    # immutable only where no -wal holds committed turns (it would be ignored); else plain mode=ro,
    # which reads the -wal through an existing -shm
    wal = path.with_name(path.name + "-wal")
    uri = f"{path.resolve().as_uri()}?mode=ro" + ("" if wal.exists() else "&immutable=1")
    db = Database(sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=True), execute_plugins=False)
    if _needs_migration(db, path):
        raise ReadOnlyStoreError(f"the database {path} needs a schema upgrade but its data dir {path.parent} is "
                                 "read-only; make it writable once")
    return db


def check_database(db: Database, path: Path, full: bool = False) -> None:
    """Run SQLite's ``quick_check`` (``integrity_check`` when ``full``) and raise if it finds damage.

    ``quick_check`` reads every page but skips index-content checks: a few ms
    per MB, so commands run it once per process before any work
    (:func:`get_db`); ``kvchat cache verify`` runs the full check.

    Raises:
        DamagedDatabaseError: the first problem SQLite reports, and where backups are.
    """
    pragma = "integrity_check" if full else "quick_check"
    try:
        rows = [r[0] for r in db.execute(f"PRAGMA {pragma}(5)").fetchall()]
    except sqlite3.DatabaseError as exc:  # too damaged to walk: "malformed", "not a database"
        if isinstance(exc, sqlite3.OperationalError):  # locked, I/O: not damage
            raise
        rows = [str(exc)]
    if rows != ["ok"]:
        raise DamagedDatabaseError(f"the database {path} is damaged ({pragma}: {' '.join(rows[0].split())}); "
                                   f"nothing was changed{_backups_hint(path) or _no_backup_hint(path)}")


def _no_backup_hint(path: Path) -> str:
    """The next step for a damaged database without backups (none in :func:`backups_dir`; the folder is not named)."""
    return ("; there is no backup of it: move it away to start a new index "
            "(its chats are lost; `kvchat cache gc` then removes the chunk files nothing indexes)")


def database_error_line(exc: sqlite3.Error, path: Path) -> str:
    """One line naming the cause of an SQLite error on the database at ``path``, for the CLI and the TUI.

    A full disk names the free space left; a read-only data dir names the folder.
    """
    code = getattr(exc, "sqlite_errorcode", 0) & 0xFF  # the primary result code of an extended one
    if code == sqlite3.SQLITE_FULL:
        import shutil

        free = shutil.disk_usage(path.parent).free
        return (f"no space left for the database {path} ({free / 1e6:.1f} MB free on its disk); nothing was "
                "stored: free some space (or run 'kvchat cache purge') and try again")
    if not writable(path):
        return f"the data dir {path.parent} is read-only; this needs to write to {path}; nothing was changed"
    if code == sqlite3.SQLITE_READONLY:
        return f"the database file {path} is read-only; this needs to write to it; nothing was changed"
    return f"the database {path} cannot be used ({' '.join(str(exc).split())}){_backups_hint(path)}"


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
            f"restore it from {backups_dir(path)} if one is there, or move it away to start a new index")


def get_db(path: Path, *, on_full_disk: bool = False) -> Database:
    """The calling thread's connection to the database file ``path``, opened on first use
    (``on_full_disk``: see :func:`connect`; only the first call's counts).

    Keyed by the resolved path, so another path (a changed ``$KVCHAT_HOME`` in tests) opens a new one.

    Raises:
        the errors of :func:`connect`.
    """
    conns: dict[str, Database] = _local.__dict__.setdefault("conns", {})
    key = str(Path(path).resolve())
    if key not in conns:
        conns[key] = connect(Path(key), on_full_disk=on_full_disk)
    return conns[key]


def get_reader(path: Path) -> Database:
    """The calling thread's read-only connection to the database file ``path`` (:func:`connect_reader`).

    Raises:
        the errors of :func:`connect_reader`.
    """
    conns: dict[str, Database] = _local.__dict__.setdefault("conns", {})
    key = str(Path(path).resolve())
    if "ro:" + key not in conns:
        conns["ro:" + key] = connect_reader(Path(key))
    return conns["ro:" + key]


def db_file(db: Database) -> Path:
    """The file ``db`` is a connection to (absolute; what :func:`connect` opened).

    The store derives the data dir from it (the KV chunk files live in its ``kv`` folder), so
    nothing in the store asks where the data dir is.
    """
    return Path(db.conn.execute("PRAGMA database_list").fetchone()[2])


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
