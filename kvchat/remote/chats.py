"""Chats held with a server: kept in kvchat's SQLite store as text, each turn sent to the server whole.

A remote chat is a conversation row whose ``model_fingerprint`` names the server it went on with last
(:func:`kvchat.server_address.server_fingerprint`) and whose ``model_name`` is that server's model; it has
no token ids (the server tokenizes, and its KV cache is its own). Its messages hold the text; its settings
hold ``server_tokens`` (the context the server counted at the last turn), ``documents`` (attached
documents' titles) and ``document_texts`` (their text, sent in the system message every turn). A turn is
stored only once the server has answered it whole, or the answer stopped after some of it came (the user
stopped it, or the server stopped sending: kept as a stopped local answer is, marked ``cancelled`` or
``interrupted``): the new chat, the rewind of a regenerated turn and the new messages commit in one
transaction, so a turn that failed before its answer began leaves nothing behind.

Runs on one thread at a time per instance, except the store-only calls (list, rename, pin, delete), which
use the calling thread's own connection.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Sequence

from kvchat.conversation.events import Emit, TurnDone
from kvchat.conversation.search import search_conversation_ids
from kvchat.conversation.streaming import TokenBatcher
from kvchat.conversation.titles import UNTITLED, ChatModelMismatchError, chat_title
from kvchat.conversation.views import (
    SYSTEM_PROMPT_FIXED,
    CacheReport,
    CacheRow,
    ChatMessage,
    ChatSummary,
    ChatView,
    ContextFullError,
)
from kvchat.documents import Document
from kvchat.engine.turn import SamplingParams, TurnStats
from kvchat.index import get_db
from kvchat.remote.client import AnswerCut, Reply, ServerClient
from kvchat.remote.figures import REPORTED_KEYS, reported_keys, reuse_line, turn_stats
from kvchat.server_address import SERVER_PREFIX, server_fingerprint, server_of
from kvchat.store.conversations import (
    Conversation,
    NewMessage,
    append_turn,
    create_conversation,
    delete_conversation,
    get_conversation,
    list_conversations,
    pin_conversation,
    rename_conversation,
    rewind_conversation,
    set_model,
    set_settings,
    settings_of,
)
from kvchat.store.db import write_transaction

NOT_HERE = "the KV cache of a chat held with a server is the server's"
CUT = ("cancelled", "interrupted")  # an answer that did not end by itself: the server's reuse line is not shown


def require_remote(conv: Conversation) -> Conversation:
    """``conv`` if it is held with a server.

    Raises:
        ChatModelMismatchError: it is a local model's chat (its history is that model's tokens, not text to send).
    """
    if server_of(conv.model_fingerprint) is None:
        raise ChatModelMismatchError(f"chat {conv.id} belongs to the local model {conv.model_name!r} (its history "
                                     "is that model's tokens); open it without --server")
    return conv


@dataclass(slots=True)
class _Chat:
    id: str | None
    title: str
    system: str | None
    documents: list[str]
    document_texts: list[str]
    messages: list[ChatMessage] = field(default_factory=list)
    tokens: int = 0  # the context the server counted at the last turn
    version: int = 0  # the stored token_ids_version the messages match


class RemoteChats:
    """The open chat and the stored chats held with ``client``'s server, answered by its ``model``.

    ``context_limit``: tokens, as the server says it (0: not known); ``batch_interval_s``: as
    :class:`kvchat.conversation.streaming.TokenBatcher`'s (0: every piece, as the CLI streams).
    """

    def __init__(self, client: ServerClient, model: str, context_limit: int = 0, batch_interval_s: float = 0.04):
        self.client, self.model, self.context_limit = client, model, context_limit
        self.batch_interval_s = batch_interval_s
        self.fingerprint = server_fingerprint(client.url)
        self.chat: _Chat | None = None
        self.last: TurnStats | None = None
        self.last_line = ""  # what the server reused for the last turn, as a status line
        self.last_keys = REPORTED_KEYS  # the counters of self.last the server gave figures for (reported_keys)

    # --- the open chat ---------------------------------------------------------------------------
    def view(self) -> ChatView | None:
        """The open chat, if any."""
        c = self.chat
        if c is None:
            return None
        return ChatView(c.id, c.title, c.system or "", list(c.documents), list(c.messages), c.tokens,
                        self.context_limit)

    def new_chat(self, system: str | None, docs: Sequence[Document] = ()) -> ChatView:
        """Open a new chat (stored at its first turn); ``docs`` go in its system message, after ``system``."""
        self.chat = _Chat(None, UNTITLED, system, [d.title for d in docs], [d.text for d in docs])
        return self.view()

    def open_chat(self, chat_id: str) -> ChatView:
        """Open a stored chat held with a server, this one or another (its text goes to this one from the next
        turn, which records it under this server and model).

        Raises:
            ConversationNotFoundError: no such chat. ChatModelMismatchError: a local model's chat.
        """
        conv = require_remote(get_conversation(get_db(), chat_id))
        messages = [ChatMessage(m.role, m.text, m.ttft_ms, m.decode_tokens_per_s, m.finish_reason or "")
                    for m in conv.messages]
        s = conv.settings
        self.chat = _Chat(conv.id, conv.title, conv.system_prompt, list(s.get("documents", [])),
                          list(s.get("document_texts", [])), messages, int(s.get("server_tokens", 0)),
                          conv.token_ids_version)
        return self.view()

    def _open(self) -> _Chat:
        if self.chat is None:
            raise LookupError("no chat is open")
        return self.chat

    def set_system_prompt(self, text: str) -> ChatView:
        """Set the open chat's system prompt; only before its first turn (as a local chat's)."""
        chat = self._open()
        if chat.messages:
            raise ValueError(SYSTEM_PROMPT_FIXED)
        chat.system = text
        return self.view()

    # --- turns -----------------------------------------------------------------------------------
    def send(self, text: str, params: SamplingParams, cancel: threading.Event, emit: Emit) -> TurnDone:
        """Send ``text`` with the open chat's history; the answer streams to ``emit`` (``TokenBatch`` events,
        then one ``TurnDone``) and the turn is stored once it is whole.

        Raises:
            ValueError: an empty prompt or bad sampling settings (nothing sent).
            ContextFullError: the server says the conversation does not fit.
            kvchat.remote.client.AnswerCut: the server stopped mid-answer; the turn was stored as a stopped one
                is (the question, and the part of the answer that came with finish reason ``interrupted``), and
                the error carries the chat's id.
            kvchat.remote.client.ServerError: the server failed before any answer came (the line says how);
                nothing was stored.
        """
        return self._turn(self._open(), text, params, cancel, emit, redo=False)

    def regenerate(self, params: SamplingParams, cancel: threading.Event, emit: Emit) -> TurnDone:
        """Replace the last answer by a new one for the same user message (errors as :meth:`send`'s, but an
        :class:`~kvchat.remote.client.AnswerCut` here leaves the chat as it was: nothing is stored, the answer
        it had stays, and the error's ``chat_id`` is None)."""
        chat = self._answered()
        return self._turn(chat, chat.messages[-2].text, params, cancel, emit, redo=True)

    def edit_last(self, text: str, params: SamplingParams, cancel: threading.Event, emit: Emit) -> TurnDone:
        """Replace the last user message by ``text`` and answer it (errors as :meth:`regenerate`'s)."""
        return self._turn(self._answered(), text, params, cancel, emit, redo=True)

    def _answered(self) -> _Chat:
        chat = self._open()
        if chat.id is None or len(chat.messages) < 2:
            raise LookupError("this chat has no answer yet")
        return chat

    def _system_message(self, chat: _Chat) -> str | None:
        parts = [chat.system] if chat.system else []
        parts += [f"# {title}\n\n{text}" for title, text in zip(chat.documents, chat.document_texts)]
        return "\n\n".join(parts) or None

    def _turn(self, chat: _Chat, text: str, params: SamplingParams, cancel: threading.Event, emit: Emit,
              redo: bool) -> TurnDone:
        if not text.strip():
            raise ValueError("the prompt is empty")
        params.validate()
        history = chat.messages[:-2] if redo else chat.messages
        system = self._system_message(chat)
        messages = ([{"role": "system", "content": system}] if system else [])
        messages += [{"role": m.role, "content": m.text} for m in history] + [{"role": "user", "content": text}]
        batcher = TokenBatcher(emit, self.batch_interval_s)
        cut: AnswerCut | None = None
        if cancel.is_set():  # stopped before it was sent: kept as a cancelled turn, as a local one is
            reply = Reply("", "cancelled", 0.0, 0.0)
        else:
            try:
                reply = self.client.chat(self.model, messages, params, cancel, batcher.add, batcher.flush)
            except ContextFullError as exc:
                limit = self.context_limit or exc.limit
                raise ContextFullError(str(exc), max(exc.needed, limit + 1), limit) from None
            except AnswerCut as exc:  # kept as a stopped answer is, then said
                if redo:  # storing the part would replace the complete answer the chat holds
                    raise AnswerCut(f"{exc}; the chat is unchanged", exc.reply) from None
                cut, reply = exc, exc.reply
        batcher.flush()
        stats = turn_stats(reply)
        tokens = stats.prompt_tokens + stats.new_tokens if reply.usage else chat.tokens
        answer = ChatMessage("assistant", reply.text, stats.ttft_ms or None, stats.decode_tokens_per_s or None,
                             reply.finish_reason)
        self._store(chat, text, answer, tokens, redo)
        chat.messages = history + [ChatMessage("user", text), answer]
        chat.tokens = tokens
        self.last, self.last_line = stats, "" if reply.finish_reason in CUT else reuse_line(reply)
        self.last_keys = reported_keys(reply)
        if cut is not None:
            raise AnswerCut(f"{cut}; the question and the part of the answer that came are kept in the chat, "
                            "marked interrupted", reply, chat.id)
        done = TurnDone(chat.id, reply.text, stats, tokens, self.context_limit)
        emit(done)
        return done

    def _store(self, chat: _Chat, user: str, answer: ChatMessage, tokens: int, redo: bool) -> None:
        """Commit the turn (creating the chat at its first one) in one transaction; on success ``chat`` gets
        its id, title and version.

        Raises:
            ConversationConflictError: another kvchat changed the chat meanwhile; nothing was stored.
        """
        db = get_db()
        settings = {"server_tokens": tokens, "documents": chat.documents, "document_texts": chat.document_texts}
        new = [NewMessage("user", user, 0, 0),
               NewMessage("assistant", answer.text, 0, 0, answer.ttft_ms, answer.tokens_per_s, answer.finish_reason)]
        with write_transaction(db):
            if chat.id is None:
                conv = create_conversation(db, title=chat_title(user), model_fingerprint=self.fingerprint,
                                           model_name=self.model, system_prompt=chat.system, settings=settings)
                chat_id, title, version = conv.id, conv.title, conv.token_ids_version
            else:
                chat_id, title, version = chat.id, chat.title, chat.version
                set_settings(db, chat_id, settings)
                set_model(db, chat_id, self.fingerprint, self.model)
            if redo:
                version = rewind_conversation(db, chat_id, 0, len(chat.messages) - 2, expected_version=version)
            version = append_turn(db, chat_id, [], new, expected_version=version)
        chat.id, chat.title, chat.version = chat_id, title, version

    # --- the store -------------------------------------------------------------------------------
    def list_chats(self, query: str = "") -> list[ChatSummary]:
        """The chats held with servers (this one or others: their text goes on with this one), pinned then
        most recent first; ``query`` searches titles and text. Their KV is a server's, so each says ``none``
        cached here. A local model's chats are not listed (their history is that model's tokens)."""
        db = get_db()
        rows = list_conversations(db, fingerprint_prefix=SERVER_PREFIX)
        if query.strip():
            hits = search_conversation_ids(db, query)
            rows = [r for r in rows if r.id in hits]
        settings = settings_of(db, [r.id for r in rows])
        return [ChatSummary(r.id, r.title, r.updated, int(settings.get(r.id, {}).get("server_tokens", 0)),
                            r.num_messages, r.pinned, "none", 0) for r in rows]

    def rename_chat(self, chat_id: str, title: str) -> None:
        """Set a chat's title (and the open chat's). Raises ConversationNotFoundError."""
        rename_conversation(get_db(), chat_id, title)
        if self.chat is not None and self.chat.id == chat_id:
            self.chat.title = title

    def pin_chat(self, chat_id: str, pinned: bool) -> None:
        """Pin or unpin a chat (it has no KV here: only its place in the list). Raises ConversationNotFoundError."""
        pin_conversation(get_db(), chat_id, pinned)

    def delete_chat(self, chat_id: str) -> None:
        """Delete a chat and its messages (closing it if open). Raises ConversationNotFoundError."""
        delete_conversation(get_db(), chat_id)
        if self.chat is not None and self.chat.id == chat_id:
            self.chat = None

    def cache_report(self) -> CacheReport:
        """This server's chats, none of whose KV is here (each row says so)."""
        return CacheReport([CacheRow(s.id, s.title, s.num_tokens, "none", 0, 0, 0, s.pinned, NOT_HERE)
                            for s in self.list_chats()])
