"""The ``chunk_refs`` table: which owner (a chat ``c_…`` or a document ``d_…``) uses which KV chunk.

One row per (owner, key). Each reference is also counted in the chunk's
``ref_count`` (:func:`kvchat.store.chunk_index.ref_chunks`), so a chunk nobody
references any more is deleted when its last owner lets go of it
(:func:`kvchat.store.chunk_index.unref_chunks`). A row may outlive its chunk
(evicted, dropped as corrupt, purged): such refs are dangling until
:func:`set_refs` or :func:`drop_dangling_refs` clears them.

Listings here import no torch (``chunk_index`` does, so the writers import it when called).
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlite_utils import Database

from .conversations import decode_token_ids
from .db import write_transaction


@dataclass(slots=True)
class OwnerUsage:
    """What one owner's chunks take (a row of ``kvchat cache ls``).

    Attributes:
        owner: the chat or document id.
        title: its title ("" when neither a chat nor a document has the id).
        chunks: chunks it references; ``bytes`` their size.
        pinned: whether the chat or document is pinned.
        token_ids: the chat's history (None for a document or an unknown owner).
        document_tokens: the document's prefix tokens (None for a chat or an unknown owner).
    """

    owner: str
    title: str
    chunks: int
    bytes: int
    pinned: bool
    token_ids: list[int] | None
    document_tokens: int | None


@dataclass(slots=True, frozen=True)
class OwnedChunk:
    """A chunk an owner references: its place in a chain (``parent_key``, None at token 0) and size in tokens."""

    key: str
    parent_key: str | None
    token_count: int
    fingerprint: str


def owner_fingerprints(db: Database, owner: str) -> list[str]:
    """The cache fingerprints of the chunks ``owner`` (a chat or document id) references."""
    return [r["fp"] for r in db.query(
        "SELECT DISTINCT k.fingerprint AS fp FROM chunk_refs r JOIN kv_chunks k ON k.key = r.key WHERE r.owner = ?",
        [owner])]


def owner_bytes(db: Database, fingerprint: str | None = None) -> dict[str, int]:
    """Chunk bytes referenced by each owner; with ``fingerprint``, only chunks stored under it count."""
    where, args = ("WHERE k.fingerprint = ?", [fingerprint]) if fingerprint else ("", [])
    rows = db.query("SELECT r.owner, sum(k.bytes) AS b FROM chunk_refs r JOIN kv_chunks k ON k.key = r.key"
                    f" {where} GROUP BY r.owner", args)
    return {r["owner"]: r["b"] for r in rows}


def list_owners(db: Database) -> list[OwnerUsage]:
    """Every owner with at least one stored chunk, largest first."""
    rows = db.query(
        "SELECT r.owner, coalesce(c.title, d.title, '') AS title, count(*) AS chunks, coalesce(sum(k.bytes), 0) AS bytes,"
        " coalesce(c.pinned, d.pinned, 0) AS pinned, c.token_ids, d.token_count AS document_tokens"
        " FROM chunk_refs r JOIN kv_chunks k ON k.key = r.key"
        " LEFT JOIN conversations c ON c.id = r.owner LEFT JOIN documents d ON d.id = r.owner"
        " GROUP BY r.owner ORDER BY bytes DESC"
    )
    return [OwnerUsage(r["owner"], r["title"], r["chunks"], r["bytes"], bool(r["pinned"]),
                       None if r["token_ids"] is None else decode_token_ids(r["token_ids"]), r["document_tokens"])
            for r in rows]


def owner_chunks(db: Database, owner: str) -> list[OwnedChunk]:
    """The stored chunks ``owner`` references."""
    return [OwnedChunk(r["key"], r["parent_key"], r["token_count"], r["fingerprint"]) for r in db.query(
        "SELECT k.key, k.parent_key, k.token_count, k.fingerprint FROM chunk_refs r JOIN kv_chunks k ON k.key = r.key"
        " WHERE r.owner = ?", [owner])]


def pinned_owner_keys(db: Database) -> set[str]:
    """Keys referenced by pinned chats and pinned documents."""
    return {r["key"] for r in db.query(
        "SELECT r.key FROM chunk_refs r WHERE r.owner IN (SELECT id FROM conversations WHERE pinned != 0"
        " UNION SELECT id FROM documents WHERE pinned != 0)"
    )}


def set_refs(db: Database, owner: str, keys: list[str], fingerprint: str) -> None:
    """Make ``owner`` reference exactly ``keys`` among its chunks of ``fingerprint`` (ref new ones,
    release dropped ones, deleting those nobody else uses). Its chunks under other fingerprints
    (another KV dtype or scheme, used for a turn or two) keep their references, so switching back
    still restores from disk. Keys without a row (never written) get no reference."""
    from .chunk_index import existing_keys, ref_chunks, unref_chunks

    with write_transaction(db):
        old = {r["key"] for r in db.query(
            "SELECT r.key FROM chunk_refs r LEFT JOIN kv_chunks k ON k.key = r.key"
            " WHERE r.owner = ? AND (k.fingerprint = ? OR k.key IS NULL)", [owner, fingerprint])}
        present = existing_keys(db, keys)
        new = [k for k in keys if k in present and k not in old]
        dropped = [k for k in old if k not in set(keys)]
        db.conn.executemany("INSERT OR IGNORE INTO chunk_refs (owner, key) VALUES (?, ?)", [(owner, k) for k in new])
        db.conn.executemany("DELETE FROM chunk_refs WHERE owner = ? AND key = ?", [(owner, k) for k in dropped])
        ref_chunks(db, new)
        unref_chunks(db, dropped)


def release_owner(db: Database, owner: str) -> list[str]:
    """Drop all of ``owner``'s chunk references; returns the keys deleted because nobody else used them."""
    from .chunk_index import unref_chunks

    with write_transaction(db):
        keys = [r["key"] for r in db.query("SELECT key FROM chunk_refs WHERE owner = ?", [owner])]
        db.execute("DELETE FROM chunk_refs WHERE owner = ?", [owner])
        return unref_chunks(db, keys)


def drop_dangling_refs(db: Database) -> None:
    """Delete references to chunks that no longer have a row (after a purge)."""
    with write_transaction(db):
        db.execute("DELETE FROM chunk_refs WHERE key NOT IN (SELECT key FROM kv_chunks)")
