"""A conversation as token ids, built append-only from the model's own chat template.

The token list is the source of truth (docs/architecture.md, "How a message travels"): each new piece is
rendered, tokenized once and appended; generated ids are kept as produced; history
is never re-rendered or re-tokenized. Layout: ``[prefix][user 1][assistant 1][user 2][assistant 2]...`` where

- prefix = kvchat's system prompt (always given explicitly), then one message per
  attached document, in order, with role ``"system"`` and content
  ``"Document: {title}\\n\\n{text}"`` (:func:`document_message`). Each message ends
  with the template's end-of-turn token, so BPE cannot merge a document's last
  characters with what follows, and ``prefix_ids(s, [a])`` is a prefix of
  ``prefix_ids(s, [a, b])``: chats that share (system, documents) share ids.
- user k = the user message plus the generation prompt (``<|im_start|>assistant\\n``).
- assistant k = the generated ids, then :meth:`ChatFormat.assistant_close_ids`.

Nothing is hand-written per model: each piece is cut out of a real rendering of
a skeleton conversation of sentinel strings, after the previous message's sentinel
and its closing text. A cut must start with a special token (HF tokenizers split
those out before BPE); the constructor checks that, and that split = whole ids on
the skeleton.

Message content (system prompt, document titles and texts, user messages) is
tokenized as literal text: a user who types ``<|im_end|>`` gets the characters,
never the control token. Each piece is rendered twice, with the real content and
with a sentinel; the template's own text around the content is encoded as usual
(its special tokens stay special) and the run of plain text that holds the content
is encoded with the tokenizer's ``split_special_tokens=True``. For content without
special-token strings the ids equal those of encoding the whole rendering.

How the templates that break "render the whole list again" are handled:

- Default system prompt injection (SmolLM2's "You are a helpful AI assistant named
  SmolLM..." when messages[0] is not a system message): kvchat's system prompt is
  always passed explicitly, also when it is "", so no template default reaches ids.
- Today's date (Llama-3.2 ``strftime_now("%d %b %Y")`` unless ``date_string``
  is defined): the date is pinned per :class:`ChatFormat` (``date_string``,
  stored with the chat by the caller). A template that stamps the clock even
  when ``date_string`` is given is refused with :class:`ChatTemplateError`.
- Dropped reasoning (Qwen3 removes ``<think>...</think>`` from assistant turns
  before the last user query, and its ``enable_thinking=False`` empty think
  block): generated ids are kept, think block included, and new user turns
  are cut from a skeleton anchored on the previous assistant message, so the
  way the template re-renders history never reaches the ids. The reasoning
  policy (``template_kwargs={"enable_thinking": False}``) is fixed per
  ChatFormat, i.e. per chat.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Iterable

import jinja2

KINDS = ("prefix", "user", "assistant")
# A user message whose text is at least this many tokens is a pasted document (see ChatFormat.user_turn).
# Typed messages stay well below it (a long paragraph is ~150 tokens); a pasted file or page is above it.
# It equals one disk chunk (kvchat.engine.persistence.CHUNK_TOKENS, asserted in tests/model/test_chat_format_pasted.py):
# below that a message never fills a chunk of its own, so its reuse across chats rests on the pool alone.
PASTED_DOCUMENT_TOKENS = 256
_PARAGRAPH_BREAK = re.compile(r"[ \t]*\r?\n[ \t]*\r?\n\s*")  # a blank line (LF or CRLF), and the blanks after it
# Text around a paragraph break whose split must tokenize as the whole (ChatFormat.__init__ probes it).
_BREAK_PROBES = (("A.", " \n\n B"), ("A.", "\r\n\r\nB"), ("x", "\n \n\t\ty"))
DOC_ROLE = "system"
_SENT_SYSTEM, _SENT_DOC, _SENT_USER, _SENT_ASSISTANT, _SENT_DATE, _SENT_CONTENT = (
    f"KVCHAT-SENTINEL-{name}" for name in ("SYSTEM", "DOCUMENT", "USER", "ASSISTANT", "DATE", "CONTENT"))


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot be used to build a conversation append-only."""


@dataclass(slots=True)
class UserTurn:
    """A user turn's ids and, when the message is a pasted document, where the document part ends.

    Attributes:
        ids: the turn's ids (message, then the generation prompt).
        document_end: offset into ``ids`` just after the document part (None: not a pasted document).
        document_chars: length of the document part, in characters of the message content as the template
            renders it (the message text itself for templates that do not alter it; 0 when not a pasted document).
        question: text other than blanks follows the document part (a document, then a question).
    """

    ids: list[int]
    document_end: int | None = None
    document_chars: int = 0
    question: bool = False


@dataclass(slots=True)
class Segment:
    """One piece of a conversation's token list: ids[start:end] (token offsets, end exclusive).

    kind is "prefix" (system prompt + documents), "user" (user message + generation
    prompt) or "assistant" (generated ids + closing ids).
    """

    kind: str
    start: int
    end: int


def append_segment(ids: list[int], segments: list[Segment], kind: str, new_ids: Iterable[int]) -> None:
    """Append ``new_ids`` to ``ids`` (in place) and record them in ``segments``.

    Consecutive appends of the same kind extend the last segment (an assistant
    turn arrives as generated ids, then its closing ids).

    Raises:
        ValueError: ``kind`` is not one of KINDS.
    """
    if kind not in KINDS:
        raise ValueError(f"segment kind must be one of {KINDS}, got {kind!r}")
    start = len(ids)
    ids.extend(new_ids)
    if segments and segments[-1].kind == kind and segments[-1].end == start:
        segments[-1].end = len(ids)
    else:
        segments.append(Segment(kind, start, len(ids)))


def document_message(title: str, text: str) -> dict[str, str]:
    """The chat message a document is rendered as inside the prefix segment."""
    return {"role": DOC_ROLE, "content": f"Document: {title}\n\n{text}"}


def _msg(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


class ChatFormat:
    """Token ids for each piece of a conversation, derived from a HF tokenizer's chat template.

    Args:
        tokenizer: a transformers tokenizer with ``chat_template`` set.
        date_string: the date templates stamp into the system header (Llama-3.2
            style, e.g. "26 Jul 2024"); default today's date as "%d %b %Y". Store it
            with the chat and pass it again to keep the chat's ids reproducible.
        template_kwargs: extra template variables fixed for the chat, e.g.
            ``{"enable_thinking": False}`` for Qwen3.
        extra_stop_ids: more ids that end generation (e.g. generation_config's
            eos_token_id list).

    Raises:
        ChatTemplateError: no chat template, a template that raises on the skeleton
            conversation, stamps the clock despite date_string, renders history
            differently once a turn is appended (other than the assistant's own
            content), renders the first user turn differently from later ones,
            produces a piece that does not start with a special token, or tokenizes a
            message differently when its content is encoded as literal text.
    """

    def __init__(self, tokenizer, date_string: str | None = None,
                 template_kwargs: dict | None = None, extra_stop_ids: Iterable[int] = ()):
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError("the tokenizer has no chat template")
        self._tokenizer = tokenizer
        self._specials = tuple(t.content for t in tokenizer.added_tokens_decoder.values() if t.special)
        self.date_string = date_string or datetime.now().strftime("%d %b %Y")
        self.template_kwargs = {**(template_kwargs or {}), "date_string": self.date_string}
        system = _msg("system", _SENT_SYSTEM)
        self._after_system = [system]
        self._after_doc = [system, _msg(DOC_ROLE, _SENT_DOC)]
        self._after_assistant = [system, _msg("user", _SENT_USER), _msg("assistant", _SENT_ASSISTANT)]
        self._check_clock(str(tokenizer.chat_template))
        close_text = self._tail(self._after_assistant)
        if not close_text:
            raise ChatTemplateError("the chat template renders nothing after an assistant message")
        self._close_ids = self._encode(close_text)
        first = self._delta(self._after_system, _msg("user", _SENT_USER), True)
        later = self._delta(self._after_assistant, _msg("user", _SENT_USER), True)
        if first != later:
            raise ChatTemplateError(f"the chat template renders the first user turn ({first!r}) "
                                    f"differently from later ones ({later!r})")
        doc = document_message(_SENT_DOC, _SENT_DOC)
        for skeleton, piece in ((self._after_system, self._delta(self._after_system, doc, False)),
                                (self._after_doc, self._delta(self._after_doc, doc, False)),
                                (self._after_assistant, later)):
            self._check_split(self._tail(skeleton), piece)
        head = tokenizer.convert_ids_to_tokens(self._close_ids[0])
        if close_text.startswith(head):
            self._check_split(head, close_text[len(head):])
        for skeleton, message, gen in (([], _msg("system", _SENT_SYSTEM), False), (self._after_system, doc, False),
                                       (self._after_assistant, _msg("user", _SENT_USER), True)):
            self._check_literal_split(*self._frame(skeleton, message, gen))
        self._split_at_breaks = self._breaks_are_token_neutral()
        specials = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
        self.stop_token_ids: set[int] = set(extra_stop_ids) | {tokenizer.eos_token_id} - {None}
        self.stop_token_ids |= {self._close_ids[0]} & specials

    def prefix_ids(self, system: str, documents: list[tuple[str, str]]) -> list[int]:
        """Token ids of the prefix segment: ``system`` then each (title, text) document in order.

        ``system`` is always rendered as a system message (even ""), so no template
        default is injected. Deterministic: equal inputs give equal ids in any process.

        Special-token strings in ``system``, titles and texts are kept as literal text.

        Raises:
            ChatTemplateError: the template fails on these messages, or renders the text
                around a message differently depending on its content.
        """
        ids = self._message_ids([], _msg("system", system), False)
        for i, (title, text) in enumerate(documents):
            skeleton = self._after_system if i == 0 else self._after_doc
            ids += self._message_ids(skeleton, document_message(title, text), False)
        return ids

    def user_turn_ids(self, text: str) -> list[int]:
        """Token ids appended for a user message: the message, then the generation prompt.

        The same ids whatever came before (prefix or a finished assistant turn).
        Special-token strings in ``text`` are kept as literal text.

        Raises:
            ChatTemplateError: the template fails on this message, or renders the text
                around it differently depending on its content.
        """
        return self.user_turn(text).ids

    def user_turn(self, text: str, role: str = "user") -> UserTurn:
        """:meth:`user_turn_ids` with the end of a pasted document's part (:class:`UserTurn`). ``role``: the
        message's role, ``"user"`` or another the template renders as a turn after an assistant message that
        the model then answers (``"tool"``: a tool result, Llama 3's ``ipython`` turn); same rules.

        A message of at least :data:`PASTED_DOCUMENT_TOKENS` tokens is a pasted document. Its document part
        is the text before its last paragraph break (a blank line, LF or CRLF) when that part alone has at
        least :data:`PASTED_DOCUMENT_TOKENS` tokens (a document, then a question), else the whole message.
        The part and the rest are tokenized as two literal runs, so the part's ids (template head included)
        are the same whatever question follows it; the constructor checked that splitting at a break gives
        the ids of the whole text for this tokenizer (else no message is split: ``document_end`` is None).
        The same rule applies wherever a user message is rendered (TUI, CLI, server), so the ids of a stored
        chat's turns are reproduced from their text. A message under :data:`PASTED_DOCUMENT_TOKENS` UTF-8
        bytes is encoded without looking for a break (a token holds at least one byte); a long one is
        encoded about once (the part, then the question).

        Raises: as :meth:`user_turn_ids`.
        """
        head, content, foot = self._frame(self._after_assistant, _msg(role, text), True)
        if not self._split_at_breaks or len(content.encode()) < PASTED_DOCUMENT_TOKENS:
            return UserTurn(self._encode_framed(head, content, foot))
        start, end = self._run_bounds(head, foot)
        before, after = self._encode(head[:start]), self._encode(foot[end:])
        framing = len(self._encode_literal(head[start:]))  # the run's template text, not counted as the message's
        cut = self._last_break(content)
        if cut is not None:
            part = self._encode_literal(head[start:] + content[:cut])
            if len(part) - framing >= PASTED_DOCUMENT_TOKENS:
                rest = self._encode_literal(content[cut:] + foot[:end])
                return UserTurn(before + part + rest + after, len(before) + len(part), cut, True)
        part = self._encode_literal(head[start:] + content)
        if len(part) - framing < PASTED_DOCUMENT_TOKENS:
            return UserTurn(self._encode_framed(head, content, foot) if end else before + part + after)
        rest = self._encode_literal(foot[:end]) if end else []
        return UserTurn(before + part + rest + after, len(before) + len(part), len(content))

    @staticmethod
    def _last_break(content: str) -> int | None:
        """Offset of the last paragraph break with text other than blanks before and after it (None: none)."""
        first = len(content) - len(content.lstrip())  # the first non-blank character
        last = None
        for m in _PARAGRAPH_BREAK.finditer(content):
            if m.start() > first and m.end() < len(content):  # the pattern ends by eating every blank after it
                last = m.start()
        return last

    def _breaks_are_token_neutral(self) -> bool:
        """Whether encoding a user message's run split at a paragraph break gives the ids of the whole run,
        for each of :data:`_BREAK_PROBES` (BPE merging no characters across the break)."""
        head, _, foot = self._frame(self._after_assistant, _msg("user", _SENT_CONTENT), True)
        start, end = self._run_bounds(head, foot)
        run_head, run_foot = head[start:], foot[:end]
        return all(self._encode_literal(run_head + a) + self._encode_literal(b + run_foot)
                   == self._encode_literal(run_head + a + b + run_foot) for a, b in _BREAK_PROBES)

    def min_user_turn_tokens(self) -> int:
        """A lower bound on ``len(user_turn_ids(text))`` for any ``text``, found without tokenizing ``text``:
        the template's ids outside the plain-text run that holds the content, plus 1 if that run holds
        template text (a non-empty string is at least one token). Lets a caller refuse a history that
        cannot fit the context before tokenizing its messages."""
        head, _, foot = self._frame(self._after_assistant, _msg("user", ""), True)
        start = max((head.rindex(t) + len(t) for t in self._specials if t in head), default=0)
        end = min((foot.index(t) for t in self._specials if t in foot), default=len(foot))
        return len(self._encode(head[:start])) + len(self._encode(foot[end:])) + bool(head[start:] + foot[:end])

    def assistant_close_ids(self, stop_id: int | None) -> list[int]:
        """Token ids appended after the generated ids when an assistant turn ends.

        Args:
            stop_id: the stop token generation ended on (kept in the generated ids),
                or None when the turn was cancelled or hit the token limit.

        Returns:
            What the template renders after an assistant message ("<|im_end|>\\n" for
            ChatML) when stop_id is None; the rest of it after its first token when
            stop_id is that token ("\\n"; [] for Llama's "<|eot_id|>"); the whole of
            it after any other stop token (e.g. "<|endoftext|>"), which is kept too.

        Raises:
            ValueError: stop_id is not in stop_token_ids.
        """
        if stop_id is None:
            return list(self._close_ids)
        if stop_id not in self.stop_token_ids:
            raise ValueError(f"token id {stop_id} is not a stop token of this chat format")
        return self._close_ids[1:] if stop_id == self._close_ids[0] else list(self._close_ids)

    def assistant_text_ids(self, text: str) -> list[int]:
        """Token ids of an assistant message kvchat did not generate (an API client's history): ``text``
        tokenized as literal text, then :meth:`assistant_close_ids` of a turn without a stop token."""
        return self._encode_literal(text) + self.assistant_close_ids(None)

    def decode(self, ids: list[int]) -> str:
        """Display text of generated ids (special tokens dropped)."""
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def _render(self, messages: list[dict], add_generation_prompt: bool, **overrides) -> str:
        try:
            return self._tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                **{**self.template_kwargs, **overrides})
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed: {exc}") from exc

    def _encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)

    def _encode_literal(self, text: str) -> list[int]:
        """Ids of ``text`` with special-token strings tokenized as ordinary characters."""
        return self._tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)

    def _piece(self, skeleton: list[dict], new: dict, add_generation_prompt: bool) -> str:
        """Text the template adds for ``new`` after ``skeleton``; the whole rendering when skeleton is []."""
        if not skeleton:
            return self._render([new], add_generation_prompt)
        return self._delta(skeleton, new, add_generation_prompt)

    def _frame(self, skeleton: list[dict], new: dict, add_generation_prompt: bool) -> tuple[str, str, str]:
        """Split the piece for ``new`` into (template text before, rendered content, template text after).

        The frame comes from rendering a sentinel in place of the content; the content is
        what the real rendering holds between the frame's two halves (a template may
        trim it, for example).
        """
        real = self._piece(skeleton, new, add_generation_prompt)
        framed = self._piece(skeleton, {**new, "content": _SENT_CONTENT}, add_generation_prompt)
        head, found, foot = framed.partition(_SENT_CONTENT)
        if not found or _SENT_CONTENT in foot:
            raise ChatTemplateError(f"the chat template does not render a {new['role']} message's content once")
        if not (len(real) >= len(head) + len(foot) and real.startswith(head) and real.endswith(foot)):
            raise ChatTemplateError(f"the chat template renders the text around a {new['role']} message "
                                    "differently depending on its content")
        return head, real[len(head):len(real) - len(foot)], foot

    def _message_ids(self, skeleton: list[dict], new: dict, add_generation_prompt: bool) -> list[int]:
        """Ids of the piece for ``new`` after ``skeleton``, its content tokenized literally."""
        return self._encode_framed(*self._frame(skeleton, new, add_generation_prompt))

    def _encode_framed(self, head: str, content: str, foot: str) -> list[int]:
        """Encode head + content + foot; only the template's text outside the content may hold special tokens.

        The plain-text run around the content (from the last special token of ``head`` to
        the first of ``foot``) is encoded as one literal piece, so BPE sees the same run
        as when the whole text is encoded.
        """
        start, end = self._run_bounds(head, foot)
        run = head[start:] + content + foot[:end]
        return self._encode(head[:start]) + self._encode_literal(run) + self._encode(foot[end:])

    def _run_bounds(self, head: str, foot: str) -> tuple[int, int]:
        """Where the plain-text run around a message's content starts in ``head`` (after its last special
        token) and ends in ``foot`` (before its first)."""
        start = max((head.rindex(t) + len(t) for t in self._specials if t in head), default=0)
        end = min((foot.index(t) for t in self._specials if t in foot), default=len(foot))
        return start, end

    def _tail(self, skeleton: list[dict]) -> str:
        """What the template renders after the last skeleton message's content (its closing)."""
        text = self._render(skeleton, False)
        last = skeleton[-1]["content"]
        if text.count(last) != 1:
            raise ChatTemplateError(f"the chat template does not render a {skeleton[-1]['role']} message verbatim")
        return text[text.index(last) + len(last):]

    def _delta(self, skeleton: list[dict], new: dict, add_generation_prompt: bool) -> str:
        """Text the template adds for ``new`` after ``skeleton``, cut after the last skeleton message."""
        tail = self._tail(skeleton)
        full = self._render(skeleton + [new], add_generation_prompt)
        last = skeleton[-1]["content"]
        cut = full.index(last) + len(last)
        if not full.startswith(tail, cut):
            raise ChatTemplateError(f"the chat template closes a {skeleton[-1]['role']} message with {tail!r} "
                                    f"but with {full[cut:cut + len(tail)]!r} once a {new['role']} message follows")
        delta = full[cut + len(tail):]
        if not delta.startswith(self._specials):
            raise ChatTemplateError(f"the chat template's {new['role']} turn {delta[:40]!r} "
                                    "does not start with a special token")
        return delta

    def _check_split(self, before: str, piece: str) -> None:
        """Raise unless ``before + piece`` tokenizes as ``before`` then ``piece`` (no merge, no strip)."""
        if self._encode(before + piece) != self._encode(before) + self._encode(piece):
            raise ChatTemplateError(f"{before!r} + {piece[:40]!r} tokenizes differently whole than split")

    def _check_literal_split(self, head: str, content: str, foot: str) -> None:
        """Raise unless literal encoding of a message equals encoding its whole text (no special strings)."""
        if self._encode_framed(head, content, foot) != self._encode(head + content + foot):
            raise ChatTemplateError(f"{head!r} + content + {foot[:40]!r} tokenizes differently when the content "
                                    "is encoded as literal text")

    def _check_clock(self, template: str) -> None:
        """Raise if the template stamps today's date although date_string is given."""
        formats = re.findall(r"strftime_now\(\s*['\"]([^'\"]+)['\"]", template)
        text = self._render(self._after_system, False, date_string=_SENT_DATE)
        stamped = [f for f in formats if datetime.now().strftime(f) in text]
        if stamped:
            raise ChatTemplateError(f"the chat template stamps the current date ({stamped[0]!r}) even when "
                                    "date_string is given; it cannot be pinned per chat")
