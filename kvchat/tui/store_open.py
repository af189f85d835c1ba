"""Open the data dir's SQLite index for the TUI, turning "cannot open it at all" into one clear line.

Imports only sqlite3 and the store (no torch), so a damaged database or a
read-only data dir is reported before the model starts loading. Nothing on
disk is changed by a failed open: :func:`kvchat.store.db.connect` fails on
the first read of a damaged file, before any write or migration backup.
"""

from __future__ import annotations

import sqlite3

from kvchat.tui.backend import StoreUnavailableError


def open_store() -> None:
    """Open (and migrate) the calling thread's connection to the index, once per thread.

    Raises:
        StoreUnavailableError: the data dir cannot be created or written, or
            the database is damaged, locked past the busy timeout, or newer
            than this kvchat.
    """
    from kvchat.index import get_db
    from kvchat.paths import db_path
    from kvchat.store.db import require_writable
    from kvchat.store.errors import DamagedDatabaseError, ReadOnlyStoreError, StoreError

    try:
        path = db_path()
    except OSError as exc:
        where = f" {exc.filename}" if exc.filename else ""
        raise StoreUnavailableError(f"the data dir{where} cannot be created ({exc.strerror or exc}); "
                                    "set KVCHAT_HOME to a writable folder") from exc
    try:
        require_writable(path)  # the TUI stores every turn: refuse now, not after the first answer
    except ReadOnlyStoreError as exc:
        raise StoreUnavailableError(str(exc)) from exc
    try:
        get_db()
    except OSError as exc:
        raise StoreUnavailableError(f"the database {path} cannot be opened ({exc.strerror or exc}); "
                                    f"check that {path.parent} is writable; nothing was changed") from exc
    except DamagedDatabaseError as exc:  # already one line naming the damage and the backups
        raise StoreUnavailableError(str(exc)) from exc
    except (sqlite3.DatabaseError, StoreError) as exc:
        detail = " ".join(str(exc).split())
        hint = (f"check that {path.parent} is writable" if isinstance(exc, sqlite3.OperationalError)
                else "move it aside to start afresh")
        raise StoreUnavailableError(f"the database {path} cannot be used ({detail}); it was left as it is; "
                                    f"{hint}") from exc
