"""Tools as the model's own chat template renders them, where kvchat can follow it (Qwen2.5/Qwen3 and other
Hermes-style templates): the template's tool block in the system message, the template's call format.

kvchat builds a conversation append-only from the template's message pieces
(:class:`kvchat.model.chat_format.ChatFormat`), so it follows a template's tools only where they stay in
one piece that never changes: a template that renders ``tools=`` inside the system message (the text
around the system content as without tools) has that message's content, tool block included, rendered
as a plain system prompt, the prefix segment; and a template that writes an assistant call as
``<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>`` (Qwen's) has its calls forced, parsed
and resent in that format. Other templates (tools in the first user message, as Llama 3.1's default, or
before the last one, as Mistral's; no tools at all, as SmolLM2's) get the generic format
(:data:`kvchat.server.tools.GENERIC`).
"""

from __future__ import annotations

import functools

import jinja2

from kvchat.server.tools import QWEN_CALLS, Tool, ToolStyle

_SENT_SYSTEM = "\u2063kvchat-system\u2063"  # stand-ins no real text holds, found again in the rendering
_SENT_ARGUMENTS = "\u2063kvchat-arguments\u2063"
_PROBE = Tool("kvchat_probe", "A probe.", {"type": "object", "properties": {"a": {"type": "integer"}}})


class TemplateToolsError(ValueError):
    """The template renders these tools where kvchat cannot follow it (outside the system message)."""


def template_tool_style(tokenizer, template_kwargs: dict) -> ToolStyle | None:
    """The style of a chat template that renders tools in the system message and writes Qwen's calls; None
    for any other template (the caller uses the generic format). ``template_kwargs``: the chat format's
    (:attr:`kvchat.model.chat_format.ChatFormat.template_kwargs`)."""
    try:
        system = system_with_tools(tokenizer, template_kwargs, _SENT_SYSTEM, [_PROBE])
        call = {"id": "call_0", "type": "function", "function": {"name": _PROBE.name, "arguments": _SENT_ARGUMENTS}}
        rendered = _render(tokenizer, template_kwargs, [{"role": "system", "content": _SENT_SYSTEM},
                                                         {"role": "user", "content": "?"},
                                                         {"role": "assistant", "content": "", "tool_calls": [call]}],
                           [_PROBE])
    except (jinja2.TemplateError, TypeError, ValueError):  # TemplateToolsError is a ValueError
        return None
    if _PROBE.name not in system or QWEN_CALLS.call_text(_PROBE.name, _SENT_ARGUMENTS) not in rendered:
        return None
    return ToolStyle(QWEN_CALLS.open, QWEN_CALLS.between, QWEN_CALLS.close,
                     functools.partial(system_with_tools, tokenizer, dict(template_kwargs)))


def system_with_tools(tokenizer, template_kwargs: dict, system: str, tools: list[Tool]) -> str:
    """The system message content that, rendered without tools, gives what the template renders for a system
    message ``system`` with ``tools``.

    Raises:
        TemplateToolsError: the template failed, or renders the tools outside the system message's frame.
    """
    try:
        head, found, foot = _render(tokenizer, template_kwargs, [{"role": "system", "content": _SENT_SYSTEM}],
                                    None).partition(_SENT_SYSTEM)
        whole = _render(tokenizer, template_kwargs, [{"role": "system", "content": system}], tools)
    except jinja2.TemplateError as exc:
        raise TemplateToolsError(f"the chat template failed: {exc}") from None
    if not (found and len(whole) >= len(head) + len(foot) and whole.startswith(head) and whole.endswith(foot)):
        raise TemplateToolsError("the chat template renders tools outside the system message")
    return whole[len(head):len(whole) - len(foot)]


def _render(tokenizer, template_kwargs: dict, messages: list[dict], tools: list[Tool] | None) -> str:
    return tokenizer.apply_chat_template(messages, tools=[t.openai() for t in tools] if tools else None,
                                         tokenize=False, add_generation_prompt=False, **template_kwargs)
