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


def test_response_format_text_is_accepted_and_others_are_named_in_the_refusal():
    assert _parse(response_format={"type": "text"}).user == "hi"
    with pytest.raises(ApiError, match="response_format 'json_schema' is not supported") as err:
        _parse(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {}}})
    assert err.value.status == 400 and err.value.param == "response_format"


def test_penalties_reach_the_sampling_params_and_are_range_checked():
    p = _parse(presence_penalty=0.5, frequency_penalty=-1).params
    assert (p.presence_penalty, p.frequency_penalty) == (0.5, -1.0)
    with pytest.raises(ApiError, match=r"frequency_penalty must be a number in \[-2, 2\]"):
        _parse(frequency_penalty=2.5)


@pytest.mark.parametrize("name,value", [("logit_bias", {"50256": -100}), ("top_logprobs", 2), ("logprobs", True),
                                        ("function_call", "auto"), ("modalities", ["text", "audio"]),
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
    assert _parse(user="u1", metadata={"k": "v"}, store=False, logprobs=False, tools=[], logit_bias=None,
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
