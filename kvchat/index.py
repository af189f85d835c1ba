"""The index of the current data dir: :mod:`kvchat.store` opened at :func:`kvchat.paths.db_path`.

The store takes every path from its caller; these accessors are where kvchat
supplies them (``$KVCHAT_HOME``, so a test's fresh data dir is picked up on the next call).
"""

from __future__ import annotations

from pathlib import Path

from sqlite_utils import Database

from kvchat.paths import data_dir, db_path
from kvchat.store import db as store_db


def get_db(*, on_full_disk: bool = False) -> Database:
    """The calling thread's connection to the data dir's index (:func:`kvchat.store.db.get_db`; ``on_full_disk``
    for upkeep commands: see :func:`kvchat.store.db.connect`)."""
    return store_db.get_db(db_path(), on_full_disk=on_full_disk)


def get_reader() -> Database:
    """The calling thread's read-only connection to the data dir's index, for listings (also on a full disk;
    :func:`kvchat.store.db.get_reader`)."""
    return store_db.get_reader(db_path())


def kv_dir() -> Path:
    """The data dir's chunk-file folder (:func:`kvchat.store.snapshot.kv_dir`)."""
    from kvchat.store.snapshot import kv_dir as store_kv_dir  # imports torch: only when asked

    return store_kv_dir(data_dir())
