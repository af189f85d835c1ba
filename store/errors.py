"""Exceptions raised by :mod:`kvchat.store`.

Every message is one line, so the CLI can print it as a single stderr line.
"""

from __future__ import annotations


class StoreError(Exception):
    """Base class for errors of the persistent store (SQLite index, KV snapshots)."""


class MigrationError(StoreError):
    """A schema migration failed; the database was left as it was before."""


class TruncatedDatabaseError(StoreError):
    """The database file is empty while KV chunk files exist beside it: it was truncated, not new."""


class DamagedDatabaseError(StoreError):
    """SQLite's ``quick_check`` or ``integrity_check`` found the database damaged."""


class ReadOnlyStoreError(StoreError):
    """The data dir cannot be written, and the command needs to write (or the schema needs a migration)."""


class SchemaTooNewError(StoreError):
    """The database carries migrations this version of kvchat does not know."""


class ConversationNotFoundError(StoreError, LookupError):
    """No conversation has the given id."""


class DocumentNotFoundError(StoreError, LookupError):
    """No document has the given id."""


class ConversationConflictError(StoreError):
    """The conversation changed since the caller read it (another writer appended a turn)."""


class CorruptChunkError(StoreError):
    """A KV chunk file is missing, truncated, malformed or fails its checksum.

    ``kind`` is a short machine-readable reason for ``miss_reason`` reports:
    one of ``missing``, ``truncated``, ``header``, ``mismatch``, ``checksum``.
    """

    def __init__(self, path: object, kind: str, detail: str) -> None:
        self.path = path
        self.kind = kind
        super().__init__(f"corrupt KV chunk {path}: {kind}: {detail}".replace("\n", " "))
