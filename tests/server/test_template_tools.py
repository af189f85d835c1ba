"""Tools in the model's own chat template: the Qwen3 template in tests/data/templates (Hermes-style tools in
the system message, ``<tool_call>`` calls with Qwen's spacing) on the real SmolLM2 runtime in-process (its
tokenizer's template swapped, as tests/server/test_prefix.py does), and the generic format for SmolLM2's own
template, which has no tools."""

from __future__ import annotations

import json
import queue
from pathlib import Path

import jsonschema
import pytest
from transformers import AutoTokenizer

from kvchat.conversation.records import new_settings
from kvchat.runtime import load_runtime
from kvchat.server.protocol import answer_message, parse_chat_request
from kvchat.server.scheduler import Job, Scheduler
from kvchat.server.template_tools import template_tool_style
from kvchat.server.tools import GENERIC, QWEN_CALLS

TEMPLATES = Path(__file__).parents[1] / "data" / "templates"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                           "parameters": WEATHER}}]


@pytest.fixture(scope="module")
def qwen_rt(smol_info):
    """The real runtime with the Qwen3-style template in place of SmolLM2's."""
    rt = load_runtime(None, "fp8")
    rt.tokenizer.chat_template = (TEMPLATES / "qwen3.jinja").read_text()
    return rt


def test_a_template_without_tools_gets_the_generic_format(smol_dir):
    tok = AutoTokenizer.from_pretrained(smol_dir)
    assert template_tool_style(tok, {}) is None
    req = parse_chat_request(json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                         "tools": TOOLS}).encode(), GENERIC)
    assert "# Tools: get_weather" in req.system


def test_the_qwen_template_renders_the_tools_and_a_forced_call_parses_into_tool_calls(qwen_rt):
    sched = Scheduler(qwen_rt, store=False)
    try:
        style = sched.tool_style
        assert (style.open, style.between, style.close) == (QWEN_CALLS.open, QWEN_CALLS.between, QWEN_CALLS.close)
        body = {"model": "m", "temperature": 0, "max_tokens": 60, "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                "messages": [{"role": "system", "content": "You are terse."},
                             {"role": "user", "content": "What is the weather in Lisbon?"}]}
        req = parse_chat_request(json.dumps(body).encode(), style)
        fmt = qwen_rt.chat_format(new_settings([]))
        own = qwen_rt.tokenizer.apply_chat_template([{"role": "system", "content": "You are terse."}], tools=TOOLS,
                                                    tokenize=False, **fmt.template_kwargs)
        assert fmt.prefix_ids(req.system, []) == qwen_rt.tokenizer.encode(own, add_special_tokens=False)
        assert "# Tools\n\nYou may call one or more functions" in req.system and '"name": "get_weather"' in req.system
        sched.grammars.wait()
        got: queue.Queue = queue.Queue()
        sched.submit(Job(req, got.put))
        item = got.get(timeout=120)
        while item[0] == "text":
            item = got.get(timeout=120)
        assert item[0] == "done", item
        done = item[1]
        assert done.text.startswith('<tool_call>\n{"name": "get_weather", "arguments": {'), done.text
        message, finish = answer_message(req, done.text, done.finish_reason)
        assert finish == "tool_calls", message
        [call] = message["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)
        resent = parse_chat_request(json.dumps({**body, "messages": body["messages"] + [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "21 C"}]}).encode(), style)
        assert resent.turns[0][1] == done.text  # resent in the template's own format, the text generated
    finally:
        sched.stop()
