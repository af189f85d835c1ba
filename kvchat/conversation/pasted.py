"""Documents pasted into a chat: a long first user message, or a long system message, kept as a reusable prefix.

An API client (or a TUI or CLI user) pastes a document into a new chat's first user message, then asks about
it; the next conversation pastes it again with another question. Such a message is split by
:meth:`kvchat.model.chat_format.ChatFormat.user_turn` into its document part and the question, the part's
ids the same whatever follows it. After the turn is stored, the prefix up to the part's end (system prompt,
the user turn's template head, the document) is recorded in the ``documents`` table as ``kvchat doc add``
records a file (``kvchat doc ls``, pinning, ``doc rm``) and references the chat's own chunks up to that end
(the chat's snapshot has a tail there), so a later request repeating it restores it in full from disk.

Only there can another conversation reuse it: a long message in a later turn follows that chat's own
history, so it keeps its chunk edge and tail in the chat's snapshot (a regenerate or edit reuses it) but gets
no row; nor does a message without a question after the document (nothing to tell the next question from).
A system message of at least :data:`~kvchat.model.chat_format.PASTED_DOCUMENT_TOKENS` tokens (a document
pasted as instructions) is the prefix segment, recorded the same way when its chat is first stored.

A pasted document lives as long as a chat containing it: deleting the last such chat deletes its row and
releases its chunks (:func:`kvchat.conversation.records.delete_chat`), unless the user pinned it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvchat.conversation.records import chat_title
from kvchat.documents import PASTED_PATH, prefix_doc_id
from kvchat.index import get_db
from kvchat.model.chat_format import PASTED_DOCUMENT_TOKENS
from kvchat.store.documents import upsert_document

# the first line of the tool definitions block an API request's tools add to its system prompt
# (kvchat/server/tools.py writes it, followed by the functions' names); such a prefix is listed as tools
TOOLS_HEADING = "# Tools: "

if TYPE_CHECKING:
    from kvchat.engine.session import Session


def register_turn_documents(session: Session, system: str, has_files: bool, user_text: str,
                            first_turn: bool) -> list[str]:
    """After a stored turn of a chat (its ``session``, its ``system`` prompt, whether it has file documents
    attached, ``has_files``): record its pasted documents and reference their chunks.

    On a new chat's ``first_turn``: a system message of at least ``PASTED_DOCUMENT_TOKENS`` tokens when no
    file document is attached. When the turn is the chat's first user turn (right after the prefix) and
    its message is a document then a question (:class:`kvchat.model.chat_format.UserTurn`): the
    document part. Id: :func:`kvchat.documents.prefix_doc_id` of the prefix's ids, so the same document
    after the same system prompt is one row. Call it after the chat's own
    :meth:`~kvchat.engine.session.Session.save_snapshot`: the documents take references on the chunks
    that save queued, nothing is read or written twice. Returns the ids recorded.
    """
    found: list[tuple[str, int]] = []  # (title, prefix end)
    prefix = session.segments[0]
    if first_turn and not has_files and prefix.end - prefix.start >= PASTED_DOCUMENT_TOKENS:
        found.append((_prefix_title(system), prefix.end))
    turn = session.last_turn
    user = turn.user
    if user is not None and user.question and user.document_end is not None and turn.user_span[0] == prefix.end:
        found.append(("pasted: " + chat_title(user_text[:user.document_chars]), prefix.end + user.document_end))
    db, ids = get_db(), []
    for title, end in found:
        did = prefix_doc_id(session.token_ids[:end])
        upsert_document(db, did, PASTED_PATH, title, end)
        session.share_snapshot(did, end)
        ids.append(did)
    return ids


def _prefix_title(system: str) -> str:
    """A stored system prompt's listing: ``tools: <names>`` when it holds an API request's tool block, else
    ``system prompt: <its first line>``."""
    at = system.find(TOOLS_HEADING)
    if at >= 0 and (at == 0 or system[at - 1] == "\n"):
        return "tools: " + chat_title(system[at + len(TOOLS_HEADING):])
    return "system prompt: " + chat_title(system)
