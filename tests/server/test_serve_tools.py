"""Tools through a real ``kvchat serve`` and the real ``openai`` client: a named tool choice gives a call whose
arguments validate (streaming too), a tool conversation (call, result, answer) is reused from disk after a
restart, ~2,000 tokens of tool definitions are a prefix reused by the next request and after a restart, and
malformed tools, choices, ``top_logprobs`` or ``n`` are 400s with OpenAI's error object that store nothing."""

from __future__ import annotations

import json
import sqlite3

import jsonschema
import openai
import pytest
from server_helpers import ask_greedy

pytestmark = pytest.mark.model

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _many_tools(n: int) -> list[dict]:
    """``n`` functions with long descriptions: an agent's tool list (~50 tokens each)."""
    return [{"type": "function", "function": {
        "name": f"tool_{i}", "description": f"Look up record {i} of the inventory database and return its fields: "
                                            "name, price, stock, supplier, last update and warehouse location.",
        "parameters": {"type": "object", "properties": {"id": {"type": "integer"}, "field": {"type": "string"}}}}}
        for i in range(n)]


def _titles(server) -> list[str]:
    db = sqlite3.connect(server.home / "kvchat.db")
    try:
        return [title for (title,) in db.execute("SELECT title FROM documents")]
    finally:
        db.close()


def _rows(server) -> int:
    db = sqlite3.connect(server.home / "kvchat.db")
    try:
        return db.execute("SELECT COUNT(*) FROM messages").fetchone()[0]
    finally:
        db.close()


def test_a_named_tool_choice_gives_a_call_whose_arguments_validate_streaming_too(server):
    c = server.client()
    msgs = [{"role": "user", "content": "What is the weather in Lisbon?"}]
    r = ask_greedy(c, msgs, max_tokens=80, tools=TOOLS, tool_choice=NAMED)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    chunks = list(ask_greedy(c, msgs, max_tokens=80, tools=TOOLS, tool_choice=NAMED, stream=True))
    [delta] = [ch.choices[0].delta.tool_calls for ch in chunks if ch.choices and ch.choices[0].delta.tool_calls]
    assert (delta[0].function.name, delta[0].function.arguments) == ("get_weather", call.function.arguments)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"


def test_bad_tools_choices_and_counts_are_400s_that_store_nothing(server):
    c = server.client()
    msgs = [{"role": "user", "content": "Hi"}]
    before = _rows(server)
    cases = [({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools", "name is required"),
             ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
             ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                                      "if": {"required": ["a"]}}}}]},
              "tools", '"if"'),
             ({"logprobs": True, "top_logprobs": 50}, "top_logprobs", "top_logprobs"),
             ({"n": 100}, "n", "n must be")]
    for fields, param, message in cases:
        with pytest.raises(openai.BadRequestError, match=message) as err:
            ask_greedy(c, msgs, max_tokens=4, **fields)
        body = err.value.body
        assert (body["param"], body["type"]) == (param, "invalid_request_error"), body
        assert set(err.value.response.json()["error"]) == {"message", "type", "param", "code"}
    assert _rows(server) == before


def test_tool_definitions_and_a_tool_conversation_are_reused_from_memory_and_from_disk_after_a_restart(server):
    c = server.client()
    tools = TOOLS + _many_tools(36)
    first = ask_greedy(c, [{"role": "user", "content": "Which tool finds stock levels?"}], max_tokens=8,
                       tools=tools, tool_choice="none")
    assert first.usage.prompt_tokens >= 2000, first.usage
    server.wait_idle()
    titles = _titles(server)  # what `kvchat doc list` shows
    assert [t for t in titles if t.startswith("tools: get_weather, get_time, tool_0, ")], titles
    other = ask_greedy(c, [{"role": "user", "content": "How warm is it in Oslo?"}], max_tokens=60, tools=tools,
                       tool_choice=NAMED)
    assert other.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 32, other.usage
    [call] = other.choices[0].message.tool_calls
    history = [{"role": "user", "content": "How warm is it in Oslo?"},
               {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}]
    answer = ask_greedy(c, history, max_tokens=24, tools=tools, tool_choice="none")
    assert answer.usage.prompt_tokens_details.cached_tokens >= other.usage.prompt_tokens - 32, answer.usage
    server.wait_idle()
    server.stop()
    server.start()
    c = server.client()
    history += [{"role": "assistant", "content": answer.choices[0].message.content},
                {"role": "user", "content": "Thanks."}]
    resumed = ask_greedy(c, history, max_tokens=4, tools=tools, tool_choice="none")
    kv = resumed.model_extra["kvchat"]
    assert kv["from_disk"] > 0 and kv["miss_reason"] is None, kv
    assert resumed.usage.prompt_tokens_details.cached_tokens >= answer.usage.prompt_tokens + \
        answer.usage.completion_tokens - 32, resumed.usage
    fresh = ask_greedy(c, [{"role": "user", "content": "Another question."}], max_tokens=4, tools=tools,
                       tool_choice="none")
    assert fresh.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 32, fresh.usage
