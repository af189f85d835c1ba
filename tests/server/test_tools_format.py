"""kvchat's tool formats (the generic one; Qwen's and Llama 3's as their templates write calls): a call
written as the model writes it parses back to the same call, its arguments verbatim; a call answer is stored
as the text its resent message renders, whatever spacing the model wrote (so a resent call maps to the
generated ids); a forced call streams as a header delta and its arguments' pieces; ``auto`` answers that are
not calls stay text, tool messages and assistant calls render into the conversation, and ``required`` or a
named function get the forced-call grammar (its effect on the model: tests/server/test_serve_tools.py)."""

from __future__ import annotations

import json

import pytest

from kvchat.server.protocol import ApiError, answer_message, parse_chat_request, stored_answer_text
from kvchat.server.tools import GENERIC, LLAMA_CALLS, QWEN_CALLS, CallPieces, Tool, call_text, first_call_end, parse_calls

WEATHER = Tool("get_weather", "", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})


def _request(style=GENERIC, **fields):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_chat_request(json.dumps(body).encode(), style)


def test_a_call_parses_back_and_renders_to_the_text_it_came_from():
    text = call_text("get_weather", '{"city":"Oslo"}')
    content, [call] = parse_calls(text, [WEATHER])
    assert content is None and (call.name, call.arguments) == ("get_weather", '{"city":"Oslo"}')
    assert call_text(call.name, call.arguments) == text
    content, calls = parse_calls("Let me check.\n" + text + "\n" + call_text("get_weather", '{"city":"Rome"}'),
                                 [WEATHER])
    assert content == "Let me check." and [json.loads(c.arguments)["city"] for c in calls] == ["Oslo", "Rome"]


def test_a_call_answer_is_stored_as_the_text_its_resent_message_renders():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER.parameters}}]
    req = _request(tools=tools)
    generated = 'Let me look.\n<tool_call> {"name": "get_weather",\n "arguments": {"city": "Oslo", "days": 2.50}}</tool_call>'
    message, finish = answer_message(req, generated, "stop")
    assert finish == "tool_calls" and message["content"] == "Let me look."
    assert message["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo", "days": 2.50}'  # verbatim
    resent = _request(tools=tools, messages=[{"role": "user", "content": "Weather in Oslo?"}, message,
                                             {"role": "tool", "tool_call_id": "x", "content": "21 C"}])
    assert resent.turns[0][1] == stored_answer_text(req, generated, "stop")
    assert stored_answer_text(req, generated, "length") == generated  # cut: not calls, stored as generated


@pytest.mark.parametrize("style", [GENERIC, QWEN_CALLS, LLAMA_CALLS], ids=["generic", "qwen", "llama"])
def test_a_forced_call_streams_a_header_then_its_arguments_piece_by_piece(style):
    arguments = '{"city":"Os}lo \\"x\\"","tags":[{"a":1}]}'
    text = style.call_text("get_weather", arguments)
    pieces, deltas = CallPieces(style), []
    for k in range(0, len(text), 3):
        deltas += pieces.feed(text[k:k + 3])
    head = deltas[0]["tool_calls"][0]
    assert (head["id"], head["type"], head["function"]) == (pieces.id, "function",
                                                            {"name": "get_weather", "arguments": ""})
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas[1:]) == arguments
    assert len(deltas) > 3


@pytest.mark.parametrize("text", ["It is sunny.", call_text("unknown", "{}"), "<tool_call>\n{not json}\n</tool_call>",
                                  call_text("get_weather", "[1]")])
def test_an_answer_that_is_not_a_valid_call_is_text(text):
    assert parse_calls(text, [WEATHER]) is None
    req = _request(tools=[{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER.parameters}}])
    assert answer_message(req, text, "stop") == ({"role": "assistant", "content": text}, "stop")


def test_tool_messages_and_assistant_calls_render_into_the_conversation():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER.parameters}}]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}
    req = _request(tools=tools, messages=[{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Weather in Oslo?"},
                                          {"role": "assistant", "content": None, "tool_calls": [call]},
                                          {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}])
    assert req.turns == [("Weather in Oslo?", call_text("get_weather", '{"city":"Oslo"}'))]
    assert req.user == "<tool_response>\n21 C\n</tool_response>"
    assert req.system.startswith("Be brief.\n\n# Tools: get_weather\n") and '"name": "get_weather"' in req.system
    assert req.tool_choice == "auto" and req.grammar is None
    with pytest.raises(ApiError, match="tool_call_id is required"):
        _request(messages=[{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}])
    with pytest.raises(ApiError, match="arguments must be a JSON object"):
        _request(messages=[{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [
            {"id": "x", "type": "function", "function": {"name": "f", "arguments": "[]"}}]},
                           {"role": "user", "content": "b"}])


def test_required_and_named_choices_force_a_call_and_other_choices_do_not():
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    assert _request(tools=tools, tool_choice="required").grammar.source == "tool call"
    assert _request(tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}}).tool_name \
        == "get_weather"
    assert _request(tools=tools, tool_choice="none").grammar is None
    with pytest.raises(ApiError, match="tool_choice 'required' needs tools"):
        _request(tool_choice="required")
    with pytest.raises(ApiError, match="cannot be combined"):
        _request(tools=tools, tool_choice="required", response_format={"type": "json_object"})


def test_a_llama_call_is_the_whole_answer_one_bare_json_object_with_parameters():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER.parameters}}]
    req = _request(LLAMA_CALLS, tools=tools)
    generated = ' {"name": "get_weather",\n "parameters": {"city": "Oslo", "days": 2.50}}'
    message, finish = answer_message(req, generated, "stop")
    assert finish == "tool_calls" and message["content"] is None
    assert message["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo", "days": 2.50}'  # verbatim
    stored = stored_answer_text(req, generated, "stop")
    assert stored == '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2.50}}'
    resent = _request(LLAMA_CALLS, tools=tools, messages=[{"role": "user", "content": "Weather in Oslo?"}, message,
                                                          {"role": "tool", "tool_call_id": "x", "content": "21 C"}])
    assert resent.turns[0][1] == stored and (resent.user, resent.user_roles) == ("21 C", ["user", "tool"])
    for text in ('Sure. {"name": "get_weather", "parameters": {}}', '{"name": "get_weather", "arguments": {}}',
                 call_text("get_weather", '{"city":"Oslo"}')):  # text around it, Qwen's key, tags: not Llama's calls
        assert answer_message(req, text, "stop") == ({"role": "assistant", "content": text}, "stop")
    assert first_call_end(stored, LLAMA_CALLS) is None and first_call_end(call_text("f", "{}")) is not None
    call = message["tool_calls"][0]
    with pytest.raises(ApiError, match="takes one call per assistant message"):
        _request(LLAMA_CALLS, tools=tools, messages=[{"role": "user", "content": "a"},
                                                     {"role": "assistant", "tool_calls": [call, call]},
                                                     {"role": "tool", "tool_call_id": "x", "content": "b"}])


def test_tool_results_render_as_the_template_turn_only_in_a_run_of_tool_results():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER.parameters}}]
    call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    head = [{"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    results = [{"role": "tool", "tool_call_id": "c", "content": "1"}, {"role": "tool", "tool_call_id": "c", "content": "2"}]
    req = _request(LLAMA_CALLS, tools=tools, messages=head + results)
    assert (req.user, req.user_roles) == ("1\n\n2", ["user", "tool"])
    req = _request(LLAMA_CALLS, tools=tools, messages=head + results[:1] + [{"role": "user", "content": "and?"}])
    assert (req.user, req.user_roles) == ("<tool_response>\n1\n</tool_response>\n\nand?", ["user", "user"])
    req = _request(QWEN_CALLS, tools=tools, messages=head + results[:1])
    assert (req.user, req.user_roles) == ("<tool_response>\n1\n</tool_response>", ["user", "user"])


@pytest.mark.parametrize("parameters", [{"type": "string"}, {"type": "array", "items": {"type": "integer"}}])
def test_parameters_that_are_not_an_object_schema_are_a_400(parameters):
    with pytest.raises(ApiError) as err:
        _request(tools=[{"type": "function", "function": {"name": "f", "parameters": parameters}}])
    assert err.value.status == 400 and err.value.param == "tools" and "object schema" in err.value.message

