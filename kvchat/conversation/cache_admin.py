"""Upkeep of the KV snapshot store without a model: what ``kvchat cache …`` and ``kvchat doc ls|rm`` do.

Each function opens this data dir's index, does one job and returns plain dataclasses
(:mod:`kvchat.conversation.views`); the CLI only prints them. Listings read through a read-only
connection (:func:`kvchat.index.get_reader`), upkeep writes through one that opens on a full disk
(``get_db(on_full_disk=True)``): a chunk file is unlinked inside its transaction before the commit, so
``purge``, ``gc`` and ``doc rm`` free space before SQLite's WAL needs any. Writes go through
``kvchat.store`` in one transaction each; snapshot files nobody references any more are deleted with
their rows (:func:`kvchat.engine.persistence.release_owner`).
"""

from __future__ import annotations

from pathlib import Path

from kvchat.conversation.views import ChainLink, ChainReport, GcResult, OwnerRow, RemovedDocument, StoreTotals
from kvchat.engine.cache_identity import expected_identity
from kvchat.engine.cache_miss import why_not_restored
from kvchat.engine.disk_budget import budget_bytes, enforce, refresh_pins
from kvchat.engine.persistence import CHUNK_TOKENS, document_tokens, find_chain, release_owner, restorable_tokens
from kvchat.index import get_db, get_reader
from kvchat.paths import db_path
from kvchat.store.chunk_index import count_other_fingerprints, delete_chunk, gc, list_chunks, totals, verify_chunks
from kvchat.store.chunk_refs import drop_dangling_refs, list_owners
from kvchat.store.conversations import get_conversation, pin_conversation
from kvchat.store.db import check_database, write_transaction
from kvchat.store.documents import delete_document, find_documents, pin_document


def owners() -> list[OwnerRow]:
    """Every chat and document that references snapshot chunks, with what a resume restores.

    ``tokens``: the tokens a resume restores from disk, of a chat's history
    (:func:`kvchat.engine.persistence.restorable_tokens`) or of a document's prefix
    (:func:`kvchat.engine.persistence.document_tokens`, as ``kvchat doc list`` shows it).
    """
    db = get_reader()
    return [OwnerRow(o.owner, o.title, _owner_tokens(db, o), o.chunks, o.bytes, o.pinned) for o in list_owners(db)]


def _owner_tokens(db, o) -> int:
    """What a resume of the owner restores from disk: of a chat its history, else its chunks' longest chain."""
    if o.token_ids is not None:
        return restorable_tokens(db, o.owner, o.token_ids)
    return document_tokens(db, o.owner, o.document_tokens)


def store_totals() -> StoreTotals:
    """Chunk count and bytes, pinned ones apart, against the disk budget (bytes)."""
    db = get_reader()
    t = totals(db)
    return StoreTotals(t.count, t.bytes, t.pinned_count, t.pinned_bytes, budget_bytes(db))


def verify() -> tuple[list[str], int]:
    """Full ``integrity_check`` of the database, then every chunk file against its checksum; corrupt chunks are
    dropped (their tokens are recomputed on the next resume).

    Returns:
        (one line per dropped chunk, chunks left and verified).

    Raises:
        kvchat.store.errors.DamagedDatabaseError: the database itself fails its integrity check.
    """
    db = get_db(on_full_disk=True)
    check_database(db, db_path(), full=True)
    bad = verify_chunks(db, drop=True)
    return [str(exc) for exc in bad], totals(db).count


def collect_garbage() -> GcResult:
    """Remove stray files and rows without a file, then enforce the disk budget."""
    db = get_db(on_full_disk=True)
    r = gc(db)
    return GcResult(r.files_removed, r.bytes_freed, r.rows_removed, enforce(db))


def pin_owner(owner: str, pinned: bool) -> None:
    """Pin (never evict) or unpin a chat (``c_…``) or a document, and re-derive the chunk pins.

    Raises:
        LookupError: no chat or document has the id.
    """
    try:
        set_pinned(get_db(on_full_disk=True), owner, pinned)
    except LookupError:  # ConversationNotFoundError, DocumentNotFoundError
        raise LookupError(f"no chat or document with id {owner!r}") from None


def set_pinned(db, owner: str, pinned: bool) -> None:
    """Set the pinned flag of a chat (``c_…``) or a document and re-derive the chunk pins (pinned chunks are
    never evicted), in one transaction.

    Raises:
        kvchat.store.errors.ConversationNotFoundError, DocumentNotFoundError: no such chat or document.
    """
    pin = pin_conversation if owner.startswith("c_") else pin_document
    with write_transaction(db):
        pin(db, owner, pinned)
        refresh_pins(db)


def purge(include_pinned: bool) -> int:
    """Delete every snapshot chunk (pinned ones too when ``include_pinned``); returns how many were deleted.

    The chats and documents stay: their next resume prefills. One transaction: the files go before it
    commits, so a full disk has room for the WAL then; with nothing to delete it writes nothing.
    """
    db = get_db(on_full_disk=True)
    with write_transaction(db):
        keys = [r.key for r in list_chunks(db) if include_pinned or not r.pinned]
        for key in keys:
            delete_chunk(db, key)
        if keys:
            drop_dangling_refs(db)
    return len(keys)


def explain_chain(chat_id: str, kv_dtype: str) -> ChainReport:
    """The chat's chunk chain on disk under the cache fingerprint a ``kv_dtype`` engine would use, and where it stops.

    Raises:
        kvchat.store.errors.ConversationNotFoundError: no such chat.
    """
    db = get_reader()
    conv = get_conversation(db, chat_id)
    model_fp = conv.model_fingerprint or ""
    identity = expected_identity(model_fp, kv_dtype, num_params=_stored_params(model_fp))
    fp = identity.fingerprint
    links, start = [], 0
    for row in find_chain(db, fp, conv.token_ids):
        links.append(ChainLink(start, start + row.token_count, row.token_count < CHUNK_TOKENS, row.key, row.bytes))
        start += row.token_count
    complete = bool(links) and start + CHUNK_TOKENS > len(conv.token_ids) - 1
    return ChainReport(conv.id, len(conv.token_ids), fp, kv_dtype, links,
                       restorable_tokens(db, conv.id, conv.token_ids, fp), None if complete else start,
                       count_other_fingerprints(db, fp), None if complete else why_not_restored(db, conv.id, identity))


def _stored_params(model_fingerprint: str) -> int:
    """The parameters the model of ``model_fingerprint`` stores (what ``--weights auto`` is resolved by), found by
    its fingerprint among the imported models and the checkpoints used in place here (headers only; nothing is
    imported); 0 where no such model is here or its weights cannot be read (no engine here runs it then; ``auto``
    is resolved as for a small model)."""
    from kvchat.model.registry import model_dir_by_fingerprint
    from kvchat.model.weights import CheckpointReader

    try:
        path = model_dir_by_fingerprint(model_fingerprint)
        return 0 if path is None else CheckpointReader(path).num_params()
    except (ValueError, OSError):  # unreadable or damaged weights (every registry error is a ValueError)
        return 0


def remove_document(spec: str) -> list[RemovedDocument]:
    """Delete the documents whose id is ``spec`` or whose stored path is ``spec`` resolved, with their unshared chunks.

    Raises:
        LookupError: nothing matches.
    """
    db = get_db(on_full_disk=True)
    rows = find_documents(db, spec, str(Path(spec).expanduser().resolve()))  # doc add stores the resolved path
    if not rows:
        raise LookupError(f"no document {spec!r} (see kvchat doc list)")
    removed = []
    for r in rows:
        chunks = release_owner(r.id)
        delete_document(db, r.id)
        removed.append(RemovedDocument(r.id, len(chunks)))
    return removed
