"""Function calling as text: the tool definitions in the system prompt, calls and results as text in the
conversation, the grammar that forces a call, and the parse of an answer into calls, in kvchat's generic
format or the model's own.

The generic format (the Hermes/Qwen2.5 convention, which small instruction-tuned models have seen):

- the system prompt ends with a ``# Tools: <names>`` block listing each function's definition as one JSON
  line inside ``<tools></tools>``, and how to call one (``kvchat doc list`` shows such a stored prefix as
  ``tools: <names>``);
- an assistant call is ``<tool_call>\\n{"name":NAME,"arguments":ARGS}\\n</tool_call>`` (several calls one per
  line), ``ARGS`` the arguments' JSON text exactly as generated; a generated call answer is stored as that
  rendering (:func:`calls_text`) whatever spacing the model wrote, so a client resending the calls renders
  the stored text, which maps back to the ids kvchat generated (the history is reused token-exactly);
- a ``tool`` message is a user turn ``<tool_response>\\n…\\n</tool_response>``.

Where the model's own chat template renders tools in a way kvchat can follow (Qwen2.5/Qwen3 and other
Hermes-style templates, Llama 3.1+'s with ``tools_in_user_message=False``:
:mod:`kvchat.server.template_tools`) its tool block and call format are used instead (a :class:`ToolStyle`);
the grammar, the parse, the stream pieces and the stored rendering are the same code for every style.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from kvchat.conversation.pasted import TOOLS_HEADING
from kvchat.engine.grammar import JSON_OPTIONS, Grammar, lark_grammar

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.DOTALL)


@dataclass(frozen=True, slots=True)
class Tool:
    """One function a request offers (``tools[i].function``)."""

    name: str
    description: str
    parameters: dict

    def openai(self) -> dict:
        """The definition as OpenAI's ``tools`` entry (what a chat template's ``tools=`` takes)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True, slots=True)
class ToolStyle:
    """How the model is told about tools and writes a call: a call is ``open + NAME + between + ARGS +
    close``, ``ARGS`` a JSON object.

    Attributes:
        key: the call object's field that holds the arguments (``arguments``; Llama 3's ``parameters``).
        tagged: calls sit in ``<tool_call></tool_call>`` tags, several one per line, after any text; False:
            an answer is a call only when it is one bare JSON object and nothing else (Llama 3.1+'s).
        result_role: how a ``tool`` message is rendered: ``"user"``, a user turn :func:`result_text`;
            ``"tool"``, the template's own turn for a tool message, its content as sent (Llama 3's
            ``ipython`` turn).
        template: None: kvchat's generic ``# Tools`` block at the end of the system prompt
            (:func:`tools_prompt`); else the model's chat template renders the tools itself, given
            ``tools=`` and these template variables (:meth:`chat_kwargs`).
    """

    open: str
    between: str
    close: str
    key: str = "arguments"
    tagged: bool = True
    result_role: str = "user"
    template: dict | None = None

    def call_text(self, name: str, arguments: str) -> str:
        """One call as the assistant writes it (``arguments``: JSON text, kept verbatim)."""
        return f"{self.open}{name}{self.between}{arguments}{self.close}"

    def system(self, parts: list[str], tools: list[Tool]) -> str:
        """The system prompt of a request offering ``tools``: its system messages ``parts`` (joined by blank
        lines), with the generic ``# Tools`` block when the template does not render the tools itself."""
        return "\n\n".join([*parts, tools_prompt(tools)] if self.template is None else parts)

    def chat_kwargs(self, tools: list[Tool]) -> dict:
        """The template variables of a chat offering ``tools`` (stored with the chat, so every piece of it is
        rendered with them): ``tools`` and the style's variables; {} for the generic format."""
        if self.template is None or not tools:
            return {}
        return {**self.template, "tools": [t.openai() for t in tools]}


# kvchat's own format for models whose template has no tools it can follow (SmolLM2's has none)
GENERIC = ToolStyle(CALL_OPEN + '\n{"name":"', '","arguments":', "}\n" + CALL_CLOSE)
# Qwen2.5/Qwen3's (Hermes') call format, as their templates render a call (the JSON's spaces included)
QWEN_CALLS = ToolStyle(CALL_OPEN + '\n{"name": "', '", "arguments": ', "}\n" + CALL_CLOSE, template={})
# Llama 3.1/3.2/3.3's custom-tool call, as their templates render one: one JSON object, the whole answer; their
# tools go in the system message only with tools_in_user_message=False (by default, in the first user message)
LLAMA_CALLS = ToolStyle('{"name": "', '", "parameters": ', "}", key="parameters", tagged=False, result_role="tool",
                        template={"tools_in_user_message": False})


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call in an answer: OpenAI's ``tool_calls[i]`` (``arguments`` is JSON text)."""

    id: str
    name: str
    arguments: str

    def body(self) -> dict:
        """OpenAI's ``tool_calls`` entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def deltas(self, index: int) -> list[dict]:
        """The call as OpenAI streams one: a first delta with ``id``, ``type``, ``function.name`` and empty
        ``arguments``, then the arguments (one piece)."""
        return [{"tool_calls": [{"index": index, "id": self.id, "type": "function",
                                 "function": {"name": self.name, "arguments": ""}}]},
                {"tool_calls": [{"index": index, "function": {"arguments": self.arguments}}]}]


def new_call_id() -> str:
    """A fresh ``tool_calls[i].id`` (``call_`` and 24 hex digits)."""
    return "call_" + secrets.token_hex(12)


def tools_prompt(tools: list[Tool]) -> str:
    """The ``# Tools`` block appended to the system prompt (deterministic: equal tools give equal text, so the
    system prompt and tools are one reusable prefix)."""
    lines = [json.dumps(t.openai(), ensure_ascii=False) for t in tools]
    return (TOOLS_HEADING + ", ".join(t.name for t in tools) + "\n\n"
            "You may call one or more of these functions. Their definitions, one per line:\n"
            "<tools>\n" + "\n".join(lines) + "\n</tools>\n\n"
            f"To call a function, answer with its name and arguments as a JSON object in {CALL_OPEN} tags:\n"
            f'{CALL_OPEN}\n{{"name":"function name","arguments":{{...}}}}\n{CALL_CLOSE}')


def call_text(name: str, arguments: str) -> str:
    """One call in the generic format (:data:`GENERIC`)."""
    return GENERIC.call_text(name, arguments)


def calls_text(content: str | None, calls: list[tuple[str, str]], style: ToolStyle = GENERIC) -> str:
    """An assistant answer of ``calls`` ``(name, arguments JSON text)`` as the model writes it: ``content`` (if
    any; an untagged style's templates drop it, as does this), then each call (:meth:`ToolStyle.call_text`), one
    per line. The one rendering of a call answer: a resent ``tool_calls`` message and the stored text of a
    generated call answer are both this, so a resent history matches the stored chat and maps back to the ids
    generated."""
    head = [content] if content and style.tagged else []
    return "\n".join(head + [style.call_text(name, arguments) for name, arguments in calls])


def first_call_end(text: str, style: ToolStyle = GENERIC) -> int | None:
    """The offset just past the first complete ``<tool_call>…</tool_call>`` block of ``text``; None if none, or
    if ``style``'s calls are not tagged (such an answer is one call or none: it ends by itself)."""
    match = _CALL.search(text) if style.tagged else None
    return None if match is None else match.end()


def result_text(content: str) -> str:
    """A ``tool`` message's content as the user turn the model reads."""
    return f"<tool_response>\n{content}\n</tool_response>"


def call_grammar(tools: list[Tool], only: str | None = None, style: ToolStyle = GENERIC) -> Grammar:
    """The grammar of exactly one call to one of ``tools`` (or to the one named ``only``) in ``style``, its
    arguments compact JSON valid against that function's ``parameters``.

    Raises:
        kvchat.engine.grammar.GrammarError: a function's ``parameters`` cannot be enforced (the message
            names the keyword).
    """
    chosen = [t for t in tools if only is None or t.name == only]
    rules = [f"start: {' | '.join(f'call_{i}' for i in range(len(chosen)))}"]
    for i, t in enumerate(chosen):
        rules.append(f"call_{i}: {json.dumps(style.open + t.name + style.between)} arguments_{i} "
                     f"{json.dumps(style.close)}")
        rules.append(f"arguments_{i}: %json {json.dumps({**t.parameters, 'x-guidance': JSON_OPTIONS})}")
    return lark_grammar("\n".join(rules), "tool call")


def parse_calls(text: str, tools: list[Tool], style: ToolStyle = GENERIC) -> tuple[str | None, list[ToolCall]] | None:
    """The calls in an answer written in ``style``: ``(the text before the first call, or None if blank; the
    calls)``, or None when the answer holds no call or one that is not a JSON object naming an offered
    function with an object of arguments (``tool_choice: auto`` then answers it as text); an untagged style's
    answer is a call only when it is one JSON object and nothing else. A call's ``arguments`` is its JSON text
    exactly as generated (what a stream sends piece by piece, see :class:`CallPieces`)."""
    if style.tagged:
        found = [(m.start(), m.group(1)) for m in _CALL.finditer(text)]
    else:
        found = [(0, text)] if text.strip().startswith("{") else []
    if not found:
        return None
    names, calls = {t.name for t in tools}, []
    for _, body in found:
        fields = _top_level_fields(body)
        if fields is None or set(fields) - {"name", style.key} or style.key not in fields:
            return None
        name, arguments = fields.get("name", (None, ""))[0], fields[style.key]
        if name not in names or not isinstance(arguments[0], dict):
            return None
        calls.append(ToolCall(new_call_id(), name, arguments[1]))
    before = text[: found[0][0]].strip()
    return (before or None), calls


def _top_level_fields(text: str) -> dict[str, tuple[object, str]] | None:
    """A JSON object's text as ``{key: (value, the value's text as written)}``; None if it is not exactly one
    JSON object (a key given twice: the last, as ``json.loads``)."""
    decoder, ws = json.JSONDecoder(), re.compile(r"[ \t\n\r]*")
    i = ws.match(text, 0).end()
    if not text.startswith("{", i):
        return None
    fields: dict[str, tuple[object, str]] = {}
    i = ws.match(text, i + 1).end()
    try:
        while not text.startswith("}", i):
            key, i = decoder.raw_decode(text, i)
            i = ws.match(text, i).end()
            if not isinstance(key, str) or not text.startswith(":", i):
                return None
            start = ws.match(text, i + 1).end()
            value, end = decoder.raw_decode(text, start)
            fields[key] = (value, text[start:end])
            i = ws.match(text, end).end()
            if text.startswith(",", i):
                i = ws.match(text, i + 1).end()
                if text.startswith("}", i):  # a trailing comma
                    return None
            elif not text.startswith("}", i):
                return None
    except json.JSONDecodeError:
        return None
    return fields if ws.match(text, i + 1).end() == len(text) else None


class CallPieces:
    """A forced call (``tool_choice`` required or named: :func:`call_grammar`'s, in a :class:`ToolStyle`)
    streamed as OpenAI streams one, while it is generated: a first delta with ``id``, ``type``,
    ``function.name`` and empty ``arguments`` once the name is complete, then each piece of the arguments'
    text as it arrives (the envelope around them is not sent). The arguments' end is found by their JSON
    nesting, so no character of the envelope is sent as theirs."""

    def __init__(self, style: ToolStyle = GENERIC):
        self.text = ""
        self.id = new_call_id()
        self._head = re.compile(re.escape(style.open) + "([A-Za-z0-9_-]{1,64})" + re.escape(style.between))
        self._start: int | None = None  # offset of the arguments' first character
        self._scanned = 0  # characters of the arguments read so far
        self._end: int | None = None  # offset just past the arguments, once they are complete
        self._depth, self._in_string, self._escaped = 0, False, False

    def feed(self, piece: str) -> list[dict]:
        """The stream deltas ``piece`` (the next generated text) completes (possibly none)."""
        self.text += piece
        out = []
        if self._start is None:
            head = self._head.match(self.text)
            if head is None:
                return out
            self._start = head.end()
            out.append({"tool_calls": [{"index": 0, "id": self.id, "type": "function",
                                        "function": {"name": head.group(1), "arguments": ""}}]})
        if self._end is None:
            begin = self._start + self._scanned
            stop = self._scan()
            if stop > begin:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": self.text[begin:stop]}}]})
        return out

    def _scan(self) -> int:
        """Read the arguments' new characters (strings, escapes and nesting); the offset reached."""
        i = self._start + self._scanned
        while i < len(self.text) and self._end is None:
            ch = self.text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:  # the arguments are a JSON object: its closing brace
                    self._end = i + 1
            i += 1
        self._scanned = i - self._start
        return i
