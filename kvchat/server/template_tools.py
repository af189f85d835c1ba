"""Tools as the model's own chat template renders them, where kvchat can follow it: the template's tool block
in the system message, the template's call format.

kvchat builds a conversation append-only from the template's message pieces
(:class:`kvchat.model.chat_format.ChatFormat`), so it follows a template's tools only where they stay in the
system message, the prefix segment (a reusable prefix cached on disk): a chat offering tools is rendered with
the template's ``tools=`` and the variables its style needs, fixed for the chat
(:meth:`kvchat.server.tools.ToolStyle.chat_kwargs`, stored in its settings), so the prefix is the template's
own system message with its tool block, and every other piece is what it is without tools.

Each supported style is a call format (:class:`kvchat.server.tools.ToolStyle`) with the template variables
it needs, tried in turn on the model's template (:data:`STYLES`):

- Qwen2.5/Qwen3 and other Hermes-style templates (:data:`kvchat.server.tools.QWEN_CALLS`): tools in the
  system message, a call ``<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>``;
- Llama 3.1/3.2/3.3 (:data:`kvchat.server.tools.LLAMA_CALLS`): with ``tools_in_user_message=False`` the tools
  in the system message (after ``Environment: ipython`` and the dates), a call the bare JSON object
  ``{"name": "NAME", "parameters": ARGS}``, one per answer.

A template whose tools land elsewhere (Llama's default, the first user message; Mistral's, before the last
user message, so the system message is the same with or without them) or that has no tools (SmolLM2's) gets
the generic format (:data:`kvchat.server.tools.GENERIC`).
"""

from __future__ import annotations

from kvchat.model.chat_format import ChatFormat
from kvchat.server.tools import LLAMA_CALLS, QWEN_CALLS, Tool, ToolStyle

STYLES = (QWEN_CALLS, LLAMA_CALLS)  # tried in this order
_PROBE = Tool("kvchat_probe", "A probe.", {"type": "object", "properties": {"a": {"type": "integer"}}})


def template_tool_style(tokenizer, template_kwargs: dict) -> ToolStyle | None:
    """The first of :data:`STYLES` the chat template follows (:func:`follows`); None for a template that
    follows none (the caller uses the generic format). ``template_kwargs``: the chat format's
    (:attr:`kvchat.model.chat_format.ChatFormat.template_kwargs`)."""
    return next((style for style in STYLES if follows(tokenizer, template_kwargs, style)), None)


def follows(tokenizer, template_kwargs: dict, style: ToolStyle) -> bool:
    """Whether the chat template, given tools and ``style``'s variables, writes an assistant call in ``style``'s
    format and renders the tools in the system message only: a chat format built with them
    (:class:`ChatFormat`, whose own checks keep every piece append-only) holds the tools in its prefix
    and not in a user turn."""
    kwargs = {**template_kwargs, **style.chat_kwargs([_PROBE])}
    call = {"id": "call_0", "type": "function", "function": {"name": _PROBE.name, "arguments": {}}}
    messages = [{"role": "system", "content": ""}, {"role": "user", "content": "?"},
                {"role": "assistant", "content": "", "tool_calls": [call]}]
    try:
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False, **kwargs)
        fmt = ChatFormat(tokenizer, kwargs.get("date_string"), kwargs)
        prefix, user = fmt.decode(fmt.prefix_ids("", [])), fmt.decode(fmt.user_turn_ids("?"))
    except Exception:  # noqa: BLE001 - a probe: a template that fails on it in any way (KeyError, IndexError, a
        return False  # raise_exception) is one kvchat does not follow; the server starts with the generic format
    return style.call_text(_PROBE.name, "{}") in rendered and _PROBE.name in prefix and _PROBE.name not in user
