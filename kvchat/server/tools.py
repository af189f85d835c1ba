"""Function calling in kvchat's generic text format: the tool definitions in the system prompt, calls and
results as text in the conversation, the grammar that forces a call, and the parse of an answer into calls.

The format (the Hermes/Qwen2.5 convention, which small instruction-tuned models have seen):

- the system prompt ends with a ``# Tools: <names>`` block listing each function's definition as one JSON
  line inside ``<tools></tools>``, and how to call one (``kvchat doc list`` shows such a stored prefix as
  ``tools: <names>``);
- an assistant call is ``<tool_call>\\n{"name":NAME,"arguments":ARGS}\\n</tool_call>`` (several calls one per
  line), ``ARGS`` the arguments' JSON text exactly as generated, so a client resending the call renders the
  ids kvchat generated and the history is reused token-exactly;
- a ``tool`` message is a user turn ``<tool_response>\\n…\\n</tool_response>``.

The model's own chat template is not asked to render tools: kvchat builds conversations append-only from
the template's message pieces (:class:`kvchat.model.chat_format.ChatFormat`), and templates render tools
in places (a system message they synthesize, a list that changes earlier text) that this cannot follow.
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


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call in an answer: OpenAI's ``tool_calls[i]`` (``arguments`` is JSON text)."""

    id: str
    name: str
    arguments: str

    def body(self) -> dict:
        """OpenAI's ``tool_calls`` entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def tools_prompt(tools: list[Tool]) -> str:
    """The ``# Tools`` block appended to the system prompt (deterministic: equal tools give equal text, so the
    system prompt and tools are one reusable prefix)."""
    lines = [json.dumps({"type": "function", "function": {"name": t.name, "description": t.description,
                                                          "parameters": t.parameters}}, ensure_ascii=False)
             for t in tools]
    return (TOOLS_HEADING + ", ".join(t.name for t in tools) + "\n\n"
            "You may call one or more of these functions. Their definitions, one per line:\n"
            "<tools>\n" + "\n".join(lines) + "\n</tools>\n\n"
            f"To call a function, answer with its name and arguments as a JSON object in {CALL_OPEN} tags:\n"
            f'{CALL_OPEN}\n{{"name":"function name","arguments":{{...}}}}\n{CALL_CLOSE}')


def call_text(name: str, arguments: str) -> str:
    """One call as the assistant writes it (``arguments``: JSON text, kept verbatim)."""
    return f'{CALL_OPEN}\n{{"name":{json.dumps(name, ensure_ascii=False)},"arguments":{arguments}}}\n{CALL_CLOSE}'


def result_text(content: str) -> str:
    """A ``tool`` message's content as the user turn the model reads."""
    return f"<tool_response>\n{content}\n</tool_response>"


def call_grammar(tools: list[Tool], only: str | None = None) -> Grammar:
    """The grammar of exactly one call to one of ``tools`` (or to the one named ``only``), its arguments
    valid against that function's ``parameters``.

    Raises:
        kvchat.engine.grammar.GrammarError: a function's ``parameters`` cannot be enforced (the message
            names the keyword).
    """
    options = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                "required": ["name", "arguments"], "additionalProperties": False}
               for t in tools if only is None or t.name == only]
    schema = {"anyOf": options, "x-guidance": JSON_OPTIONS}
    lark = (f"start: {json.dumps(CALL_OPEN + chr(10))} call {json.dumps(chr(10) + CALL_CLOSE)}\n"
            f"call: %json {json.dumps(schema)}")
    return lark_grammar(lark, "tool call")


def parse_calls(text: str, tools: list[Tool]) -> tuple[str | None, list[ToolCall]] | None:
    """The calls in an answer: ``(the text before the first call, or None if blank; the calls)``, or None
    when the answer holds no call or one that is not a JSON object naming an offered function with an
    object of arguments (``tool_choice: auto`` then answers it as text)."""
    found = list(_CALL.finditer(text))
    if not found:
        return None
    names, calls = {t.name for t in tools}, []
    for match in found:
        try:
            obj = json.loads(match.group(1))
        except json.JSONDecodeError:
            return None
        if not (isinstance(obj, dict) and obj.get("name") in names and isinstance(obj.get("arguments"), dict)):
            return None
        arguments = json.dumps(obj["arguments"], separators=(",", ":"), ensure_ascii=False)
        calls.append(ToolCall("call_" + secrets.token_hex(12), obj["name"], arguments))
    before = text[: found[0].start()].strip()
    return (before or None), calls
