"""Documents cached as reusable prefixes: one row each in the ``documents`` table.

A document's id is derived from its text by the caller (``d_`` + a hash), so
the same text attached twice is one row; its KV chunks are referenced through
``chunk_refs`` under that id. ``token_count`` is the document's own prefix
(system prompt + the document).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sqlite_utils import Database

from .db import write_transaction
from .errors import DocumentNotFoundError


@dataclass(slots=True)
class DocumentRow:
    """One stored document. ``created`` is Unix seconds."""

    id: str
    path: str
    title: str
    token_count: int
    created: float
    pinned: bool


def _row(r: dict) -> DocumentRow:
    return DocumentRow(r["id"], r["path"] or "", r["title"] or "", r["token_count"], r["created"], bool(r["pinned"]))


def upsert_document(db: Database, doc_id: str, path: str, title: str, token_count: int) -> None:
    """Record a document (again); a re-added document keeps its ``pinned`` flag."""
    with write_transaction(db):
        db.execute(
            "INSERT OR REPLACE INTO documents (id, path, content_hash, title, token_count, created, pinned)"
            " VALUES (?, ?, ?, ?, ?, ?, coalesce((SELECT pinned FROM documents WHERE id = ?), 0))",
            [doc_id, path, doc_id[2:], title, token_count, time.time(), doc_id],
        )


def list_documents(db: Database, *, newest_first: bool = False) -> list[DocumentRow]:
    """Every stored document, by creation time."""
    order = "DESC" if newest_first else "ASC"
    return [_row(r) for r in db.query(f"SELECT * FROM documents ORDER BY created {order}")]


def find_documents(db: Database, doc_id: str, path: str) -> list[DocumentRow]:
    """Documents whose id is ``doc_id`` or whose stored (resolved) path is ``path``."""
    return [_row(r) for r in db.query("SELECT * FROM documents WHERE id = ? OR path = ?", [doc_id, path])]


def pin_document(db: Database, doc_id: str, pinned: bool) -> None:
    """Set or clear the document's pinned flag (its chunks' pins: ``kvchat.engine.disk_budget.refresh_pins``).

    Raises:
        DocumentNotFoundError: no document has this id.
    """
    with write_transaction(db):
        if db.execute("UPDATE documents SET pinned = ? WHERE id = ?", [int(pinned), doc_id]).rowcount == 0:
            raise DocumentNotFoundError(f"no document with id {doc_id!r}")


def delete_document(db: Database, doc_id: str) -> None:
    """Delete the document's row (its chunks are the caller's: ``kvchat.engine.persistence.release_owner``)."""
    with write_transaction(db):
        db.execute("DELETE FROM documents WHERE id = ?", [doc_id])
