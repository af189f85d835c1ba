"""Tools through a real ``kvchat serve`` and the real ``openai`` client: a named tool choice gives a call whose
arguments validate, streamed as OpenAI streams a call (the client's accumulation gives the non-streaming
arguments), ``parallel_tool_calls: false`` ends an answer at its first call, a tool conversation (call,
result, answer) continues its stored chat token-exactly from disk after a restart, ~2,000 tokens of tool
definitions are a prefix reused by the next request and after a restart, and malformed tools (an empty
list too), choices, ``top_logprobs`` or ``n`` are 400s with OpenAI's error object that store nothing."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from server_helpers import MESSAGE_COUNT, MODEL, ask_greedy
from transformers import AutoTokenizer

pytestmark = pytest.mark.model

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# a number the model writes as "12.50": a call answer rendered back from re-serialized arguments (12.5) would
# not be the text generated, and the resent conversation would stop matching its stored chat there
CONVERT_PARAMETERS = {"type": "object", "properties": {"amount": {"type": "number"},
                                                       "currency": {"type": "string", "maxLength": 3}},
                      "required": ["amount", "currency"], "additionalProperties": False}
CONVERT = {"type": "function", "function": {"name": "convert", "description": "Convert money to dollars.",
                                            "parameters": CONVERT_PARAMETERS}}


def _many_tools(n: int) -> list[dict]:
    """``n`` functions with long descriptions: an agent's tool list (~50 tokens each)."""
    return [{"type": "function", "function": {
        "name": f"tool_{i}", "description": f"Look up record {i} of the inventory database and return its fields: "
                                            "name, price, stock, supplier, last update and warehouse location.",
        "parameters": {"type": "object", "properties": {"id": {"type": "integer"}, "field": {"type": "string"}}}}}
        for i in range(n)]


def test_a_named_tool_choice_gives_a_call_whose_arguments_validate_streamed_piece_by_piece(server):
    c = server.client()
    msgs = [{"role": "user", "content": "What is the weather in Lisbon?"}]
    r = ask_greedy(c, msgs, max_tokens=80, tools=TOOLS, tool_choice=NAMED)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    strict = [{"type": "function", "function": {**t["function"], "strict": True}} for t in TOOLS[:1]]
    with c.chat.completions.stream(model=MODEL, messages=msgs, temperature=0, max_tokens=80, tools=strict,
                                   tool_choice=NAMED) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    [streamed] = final.choices[0].message.tool_calls  # the openai client's accumulation of the deltas
    assert (streamed.function.name, streamed.function.arguments) == ("get_weather", call.function.arguments)
    assert final.choices[0].finish_reason == "tool_calls"
    deltas = [e.chunk.choices[0].delta.tool_calls[0] for e in events
              if e.type == "chunk" and e.chunk.choices and e.chunk.choices[0].delta.tool_calls]
    first = deltas[0]
    assert (first.id, first.type, first.function.name, first.function.arguments) == \
        (streamed.id, "function", "get_weather", "")
    pieces = [d.function.arguments for d in deltas[1:]]
    assert len(pieces) > 1 and "".join(pieces) == call.function.arguments  # pieces as generated


def test_parallel_tool_calls_false_ends_an_auto_answer_at_its_first_call(server, smol_dir):
    c = server.client()
    msgs = [{"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{i}", "type": "function",
                 "function": {"name": "get_weather", "arguments": json.dumps({"city": city, "unit": "celsius"})}}
                for i, city in enumerate(["Paris", "Rome"])]},
            {"role": "user", "content": "Weather in Oslo and Madrid?"}]
    # the end-of-answer token banned: after its first call the answer can only go on (another call, text)
    no_end = {str(AutoTokenizer.from_pretrained(smol_dir).eos_token_id): -100}
    free = ask_greedy(c, msgs, max_tokens=60, tools=TOOLS, logit_bias=no_end)
    assert free.choices[0].finish_reason == "length" and "<tool_call>" in free.choices[0].message.content
    one = ask_greedy(c, msgs, max_tokens=60, tools=TOOLS, logit_bias=no_end, parallel_tool_calls=False)
    assert one.choices[0].finish_reason == "tool_calls", one.choices[0]
    [call] = one.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and one.usage.completion_tokens < 60
    streamed = list(ask_greedy(c, msgs, max_tokens=60, tools=TOOLS, logit_bias=no_end, parallel_tool_calls=False,
                               stream=True))
    calls = [d for ch in streamed if ch.choices for d in ch.choices[0].delta.tool_calls or []]
    assert [d.function.name for d in calls if d.function.name] == ["get_weather"]
    assert "".join(d.function.arguments or "" for d in calls) == call.function.arguments
    forced = ask_greedy(c, msgs, max_tokens=60, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert len(forced.choices[0].message.tool_calls) == 1


def test_bad_tools_choices_and_counts_are_400s_that_store_nothing(server):
    c = server.client()
    msgs = [{"role": "user", "content": "Hi"}]
    before = server.query(MESSAGE_COUNT)
    cases = [({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools", "name is required"),
             ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
             ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                                      "if": {"required": ["a"]}}}}]},
              "tools", '"if"'),
             ({"tools": []}, "tools", "empty array"),
             ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls", "must be a boolean"),
             ({"logprobs": True, "top_logprobs": 50}, "top_logprobs", "top_logprobs"),
             ({"n": 100}, "n", "n must be")]
    for fields, param, message in cases:
        with pytest.raises(openai.BadRequestError, match=message) as err:
            ask_greedy(c, msgs, max_tokens=4, **fields)
        body = err.value.body
        assert (body["param"], body["type"]) == (param, "invalid_request_error"), body
        assert set(err.value.response.json()["error"]) == {"message", "type", "param", "code"}
    assert server.query(MESSAGE_COUNT) == before
    assert ask_greedy(c, msgs, max_tokens=2, logit_bias={}).choices[0].message.content  # OpenAI accepts it too


def test_tool_definitions_and_a_tool_conversation_are_reused_from_memory_and_from_disk_after_a_restart(server):
    c = server.client()
    tools = TOOLS + [CONVERT] + _many_tools(36)
    first = ask_greedy(c, [{"role": "user", "content": "Which tool finds stock levels?"}], max_tokens=8,
                       tools=tools, tool_choice="none")
    assert first.usage.prompt_tokens >= 2000, first.usage
    server.wait_idle()
    titles = [title for (title,) in server.query("SELECT title FROM documents")]  # what `kvchat doc list` shows
    assert [t for t in titles if t.startswith("tools: get_weather, get_time, convert, tool_0, ")], titles
    question = {"role": "user", "content": "Convert 12.50 euros to dollars."}
    named = {"type": "function", "function": {"name": "convert"}}
    call_turn = ask_greedy(c, [question], max_tokens=40, tools=tools, tool_choice=named)
    assert call_turn.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 32, call_turn.usage
    [call] = call_turn.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), CONVERT_PARAMETERS)
    server.wait_idle()
    server.stop()
    server.start()
    c = server.client()
    history = [question, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": '{"dollars": 13.6}'}]
    answer = ask_greedy(c, history, max_tokens=24, tools=tools, tool_choice="none")
    kv = answer.model_extra["kvchat"]
    assert kv["from_disk"] > 0 and kv["miss_reason"] is None, kv
    assert answer.usage.prompt_tokens_details.cached_tokens >= call_turn.usage.prompt_tokens + \
        call_turn.usage.completion_tokens - 32, answer.usage  # the call's own tokens too: the chat continues
    history += [{"role": "assistant", "content": answer.choices[0].message.content},
                {"role": "user", "content": "Thanks."}]
    resumed = ask_greedy(c, history, max_tokens=4, tools=tools, tool_choice="none")
    assert resumed.model_extra["kvchat"]["miss_reason"] is None, resumed.model_extra["kvchat"]
    assert resumed.usage.prompt_tokens_details.cached_tokens >= answer.usage.prompt_tokens + \
        answer.usage.completion_tokens - 32, resumed.usage
    fresh = ask_greedy(c, [{"role": "user", "content": "Another question."}], max_tokens=4, tools=tools,
                       tool_choice="none")
    assert fresh.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 32, fresh.usage
