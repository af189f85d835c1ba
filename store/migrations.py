"""Numbered schema migrations of the kvchat index, registered with sqlite-utils' ``Migrations``.

Rules: a migration is never edited once released; a schema change is a new
function appended at the end. :func:`migrate` backs the database up with
``VACUUM INTO`` (a plain file copy would miss the WAL) before applying
anything to a non-empty database, then applies all pending migrations in ONE
``BEGIN IMMEDIATE`` transaction (each migration is a savepoint inside it), so a
failure or a crash anywhere leaves the database exactly as it was.

Times are Unix seconds (REAL); JSON columns hold UTF-8 JSON text; token ids
are a BLOB of little-endian int32.
"""

from __future__ import annotations

import time
from pathlib import Path

from sqlite_utils import Database
from sqlite_utils.migrations import Migrations

from .errors import MigrationError, SchemaTooNewError
from .faults import crash_point

MIGRATIONS = Migrations("kvchat")


@MIGRATIONS(name="m001_core")
def m001_core(db: Database) -> None:
    """models, conversations, messages, documents."""
    db["models"].create(
        {"fingerprint": str, "name": str, "source": str, "config": str, "created": float},
        pk="fingerprint",
        not_null={"name", "created"},
    )
    db["conversations"].create(
        {
            "id": str,
            "title": str,
            "model_fingerprint": str,
            "model_name": str,
            "system_prompt": str,
            "settings": str,
            "created": float,
            "updated": float,
            "pinned": int,
            "token_ids": bytes,
            "token_ids_version": int,
            "segments": str,
        },
        pk="id",
        not_null={"title", "created", "updated", "pinned", "token_ids", "token_ids_version", "segments"},
        defaults={"title": "", "settings": "{}", "pinned": 0, "token_ids": b"", "token_ids_version": 0, "segments": "[]"},
    )
    db["messages"].create(
        {
            "id": int,
            "conversation_id": str,
            "idx": int,
            "role": str,
            "text": str,
            "token_start": int,
            "token_end": int,
            "ttft_ms": float,
            "decode_tokens_per_s": float,
            "created": float,
        },
        pk="id",
        not_null={"conversation_id", "idx", "role", "text", "token_start", "token_end", "created"},
        foreign_keys=[("conversation_id", "conversations", "id")],
    )
    db["messages"].create_index(["conversation_id", "idx"], unique=True)
    db["documents"].create(
        {"id": str, "path": str, "content_hash": str, "title": str, "token_count": int, "created": float},
        pk="id",
        not_null={"content_hash", "token_count", "created"},
    )
    db["documents"].create_index(["content_hash"])


@MIGRATIONS(name="m002_kv_chunks")
def m002_kv_chunks(db: Database) -> None:
    """kv_chunks: one row per KV snapshot file (content-addressed by ``key``)."""
    db["kv_chunks"].create(
        {
            "key": str,
            "parent_key": str,
            "fingerprint": str,
            "token_count": int,
            "file_path": str,
            "bytes": int,
            "checksum": str,
            "created": float,
            "last_used": float,
            "pinned": int,
            "ref_count": int,
        },
        pk="key",
        not_null={"fingerprint", "token_count", "file_path", "bytes", "checksum", "created", "last_used", "pinned",
                  "ref_count"},
        defaults={"pinned": 0, "ref_count": 0},
    )
    db["kv_chunks"].create_index(["parent_key"])
    db["kv_chunks"].create_index(["last_used"])


@MIGRATIONS(name="m003_fts")
def m003_fts(db: Database) -> None:
    """Full-text search over conversation titles and message text, kept current by triggers."""
    db["conversations"].enable_fts(["title"], create_triggers=True)
    db["messages"].enable_fts(["text"], create_triggers=True)


@MIGRATIONS(name="m004_chunk_refs")
def m004_chunk_refs(db: Database) -> None:
    """chunk_refs: which conversation (``c_...``) or document (``d_...``) uses which chunk key."""
    db["chunk_refs"].create({"owner": str, "key": str}, pk=("owner", "key"), not_null={"owner", "key"})
    db["chunk_refs"].create_index(["key"])
    db["documents"].add_column("pinned", int, not_null_default=0)


@MIGRATIONS(name="m005_message_finish")
def m005_message_finish(db: Database) -> None:
    """messages.finish_reason: how an answer ended (``stop``, ``length``, ``context``, ``cancelled``; NULL for
    user messages and answers stored before it was recorded)."""
    db["messages"].add_column("finish_reason", str)


@MIGRATIONS(name="m006_message_document_tokens")
def m006_message_document_tokens(db: Database) -> None:
    """messages.document_tokens: how many of a user message's tokens are its pasted document's part (0: none;
    NULL for answers and for messages stored before it was recorded, whose part is found again from the text)."""
    db["messages"].add_column("document_tokens", int)


def schema_names() -> list[str]:
    """Names of all registered migrations, oldest first."""
    return [m.name for m in MIGRATIONS.pending(Database(memory=True))]


def check_schema(db: Database) -> list:
    """The migrations ``db`` still needs (sqlite-utils ``Migration`` objects, oldest first).

    Raises:
        SchemaTooNewError: the database has migrations this kvchat does not know.
    """
    known = set(schema_names())
    unknown = [m.name for m in MIGRATIONS.applied(db) if m.name not in known]
    if unknown:
        raise SchemaTooNewError(f"database has migrations unknown to this kvchat ({', '.join(unknown)}); upgrade kvchat")
    return MIGRATIONS.pending(db)


def migrate(db: Database, backup_dir: Path) -> Path | None:
    """Apply pending migrations to ``db``; return the backup path, or None if none was made.

    A backup ``kvchat-<unix ns>-before-<first pending>.db`` is written into
    ``backup_dir`` (created 0700) when the database already holds tables.
    Concurrent openers are serialized by ``BEGIN IMMEDIATE``; the pending
    list is re-read under the lock, so two processes never apply a migration twice.

    Raises:
        SchemaTooNewError: the database has migrations this kvchat does not know.
        MigrationError: a migration raised; nothing was changed, the backup remains.
    """
    pending = check_schema(db)
    if not pending:
        return None
    backup = None
    if db.table_names():
        backup_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        backup = backup_dir / f"kvchat-{time.time_ns()}-before-{pending[0].name}.db"
        db.execute("VACUUM INTO ?", [str(backup)])
        backup.chmod(0o600)
    db.execute("BEGIN IMMEDIATE")
    try:
        MIGRATIONS.apply(db)
        crash_point("migration")
        db.execute("COMMIT")
    except Exception as exc:
        db.rollback()
        where = f"backup at {backup}" if backup else "no backup needed (database was empty)"
        raise MigrationError(f"schema migration failed ({type(exc).__name__}: {exc}); database unchanged, {where}") from exc
    return backup
