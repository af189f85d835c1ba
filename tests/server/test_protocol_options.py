"""parse_chat_request: option types the OpenAI API defines are checked, not coerced."""

from __future__ import annotations

import json

import pytest

from kvchat.server.protocol import ApiError, parse_chat_request


def test_include_usage_must_be_a_boolean():
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": "yes"}}'
    with pytest.raises(ApiError, match="include_usage must be a boolean"):
        parse_chat_request(raw)


def _parse(**fields):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_chat_request(json.dumps(body).encode())


def test_response_format_text_has_no_grammar_and_json_formats_have_one():
    assert _parse(response_format={"type": "text"}).grammar is None
    assert _parse(response_format={"type": "json_object"}).grammar.source == "response_format"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert _parse(response_format=fmt).grammar.source == "response_format.json_schema.schema"


@pytest.mark.parametrize("fmt,message", [
    ({"type": "xml"}, "response_format.type must be text, json_object or json_schema, got 'xml'"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "must be an object with a name"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "integer"}}}}, r'"not"'),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}, "foo"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "must be a JSON object"),
])
def test_a_bad_response_format_or_an_unsupported_schema_keyword_is_a_400_naming_it(fmt, message):
    with pytest.raises(ApiError, match=message) as err:
        _parse(response_format=fmt)
    assert err.value.status == 400 and err.value.param == "response_format"


def test_logprobs_and_logit_bias_are_parsed_and_range_checked():
    assert _parse().top_logprobs is None and _parse(logprobs=True).top_logprobs == 0
    assert _parse(logprobs=True, top_logprobs=20).top_logprobs == 20
    assert _parse(logit_bias={"42": -100, "7": 2.5}).logit_bias == {42: -100.0, 7: 2.5}
    for fields, param in [({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                          ({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": "yes"}, "logprobs"),
                          ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"1": 101}}, "logit_bias"),
                          ({"logit_bias": [1]}, "logit_bias")]:
        with pytest.raises(ApiError) as err:
            _parse(**fields)
        assert err.value.status == 400 and err.value.param == param, fields


def test_penalties_reach_the_sampling_params_and_are_range_checked():
    p = _parse(presence_penalty=0.5, frequency_penalty=-1).params
    assert (p.presence_penalty, p.frequency_penalty) == (0.5, -1.0)
    with pytest.raises(ApiError, match=r"frequency_penalty must be a number in \[-2, 2\]"):
        _parse(frequency_penalty=2.5)


@pytest.mark.parametrize("name,value", [("function_call", "auto"), ("modalities", ["text", "audio"]),
                                        ("repetition_penalty", 1.1)])
def test_fields_that_would_change_the_answer_and_are_not_implemented_get_400(name, value):
    with pytest.raises(ApiError) as err:
        _parse(**{name: value})
    assert err.value.status == 400 and err.value.param == name


def test_top_k_reaches_the_sampling_params_and_text_modality_is_accepted():
    assert _parse(top_k=5, modalities=["text"]).params.top_k == 5
    assert _parse().params.top_k == 0
    with pytest.raises(ApiError, match=r"top_k must be an integer"):
        _parse(top_k=-1)


def test_fields_that_do_not_change_the_answer_are_accepted():
    assert _parse(user="u1", metadata={"k": "v"}, store=False, logprobs=False, tools=None, logit_bias={},
                  parallel_tool_calls=True, service_tier="auto").user == "hi"


def test_consecutive_messages_of_one_role_are_joined_with_a_blank_line():
    body = {"model": "m", "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "A"},
                                       {"role": "user", "content": [{"type": "text", "text": "B"}]},
                                       {"role": "assistant", "content": "X"}, {"role": "user", "content": "C"},
                                       {"role": "user", "content": "D"}]}
    req = parse_chat_request(json.dumps(body).encode())
    assert (req.system, req.turns, req.user) == ("S", [("A\n\nB", "X")], "C\n\nD")
    with pytest.raises(ApiError, match="first message after the system prompt must be a user message"):
        parse_chat_request(b'{"model": "m", "messages": [{"role": "assistant", "content": "a"}, '
                           b'{"role": "user", "content": "b"}]}')


def test_n_is_one_to_eight_and_each_choice_gets_its_seed():
    from kvchat.server.choices import choice_requests

    req = _parse(n=3, seed=7)
    assert req.n == 3 and [r.params.seed for r in choice_requests(req)] == [7, 8, 9]
    assert [r.params.seed for r in choice_requests(_parse(n=2))] == [None, None]
    for fields in ({"n": 9}, {"n": 0}, {"n": 1.5}):
        with pytest.raises(ApiError) as err:
            _parse(**fields)
        assert err.value.param == "n", fields
