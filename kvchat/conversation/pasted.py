"""Documents pasted into a chat: a long user message, or a long system message, kept as a reusable prefix.

An API client (or a TUI user) pastes a document into a user message, then asks
about it; the next conversation pastes it again with another question. Such a
message is split by :meth:`kvchat.model.chat_format.ChatFormat.user_turn` into its
document part and the rest, its ids the same whatever follows the part. After
the turn is stored, the prefix up to the part's end (system prompt, earlier
turns, the user turn's template head, the document) is recorded in the
``documents`` table as ``kvchat doc add`` records a file (``kvchat doc ls``,
pinning, ``doc rm``) and snapshotted under the document's own id, with a tail
at the part's end, so a later request repeating it restores it in full from
disk, past the last full chunk. A system message of at least
:data:`~kvchat.model.chat_format.PASTED_DOCUMENT_TOKENS` tokens (a document
pasted as instructions) is the prefix segment, already stored with a tail; it
is recorded the same way when its chat is first stored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvchat.documents import prefix_doc_id
from kvchat.index import get_db
from kvchat.model.chat_format import PASTED_DOCUMENT_TOKENS
from kvchat.store.documents import upsert_document

if TYPE_CHECKING:
    from kvchat.conversation.service import ChatService

TITLE_CHARS = 48  # of the document's first non-blank line, in `kvchat doc ls` and the sidebar
PASTED_PATH = ""  # a pasted document names no file (requests never name files)


def _title(kind: str, text: str) -> str:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return f"{kind}: {line[:TITLE_CHARS]}"


def register_turn_documents(service: ChatService, user_text: str, first_turn: bool) -> list[str]:
    """After a stored turn of ``service``'s open chat: record and snapshot its pasted documents.

    The user message's document part (when :attr:`kvchat.engine.session.Turn.document_chars` says it is
    one) and, on a new chat's ``first_turn``, a system message of at least ``PASTED_DOCUMENT_TOKENS``
    tokens when no file document is attached. Id: :func:`kvchat.documents.prefix_doc_id` of the prefix's
    ids, so the same document after the same history is one row. Returns the ids recorded.
    """
    chat = service.chat
    session = chat.session
    found: list[tuple[str, int]] = []  # (title, prefix end)
    prefix = session.segments[0]
    if first_turn and not chat.settings.get("documents") and prefix.end - prefix.start >= PASTED_DOCUMENT_TOKENS:
        found.append((_title("system prompt", chat.system), prefix.end))
    turn = session.last_turn
    if turn.document_chars:
        start, end = turn.user_span
        ends = [e for e in session.sequence.document_ends if start < e <= end]
        if ends:
            found.append((_title("pasted", user_text[:turn.document_chars]), ends[-1]))
    db, ids = get_db(), []
    for title, end in found:
        prefix_ids = session.token_ids[:end]
        did = prefix_doc_id(prefix_ids)
        upsert_document(db, did, PASTED_PATH, title, end)
        service.doc_prefixes[did] = prefix_ids
        session.save_snapshot(did, upto=end)
        ids.append(did)
    return ids
