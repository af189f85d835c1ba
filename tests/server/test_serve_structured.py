"""``response_format`` through a real ``kvchat serve`` and the real ``openai`` client: answers constrained by a
JSON schema parse and validate even on the 135M default model, ``json_object`` gives an object, streaming
gives the non-streaming answer, a schema llguidance cannot enforce is a 400 that names the keyword and stores
nothing."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from server_helpers import MESSAGE_COUNT, ask_greedy

from kvchat.bench.grammar import SCHEMA

pytestmark = pytest.mark.model

PERSON = SCHEMA  # the benchmark's schema: one fact for the test and `kvchat bench grammar`
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
PEOPLE = ["a nurse from Lyon", "a retired pilot", "a young painter in Rome", "a chemistry teacher", "a chef",
          "a software engineer in Oslo", "a farmer aged 130", "a child of 5", "a violinist", "a doctor in Lagos",
          "a carpenter", "a student in Tokyo", "a marathon runner", "a librarian", "a sculptor in Paris",
          "a firefighter", "a baker aged -3", "an astronaut", "a poet", "a mathematician in Kyiv"]


def test_twenty_schema_answers_parse_and_validate(server):
    c = server.client()

    def ask(who: str):
        msgs = [{"role": "user", "content": f"Describe {who} as JSON."}]
        return ask_greedy(c, msgs, max_tokens=300, response_format=FORMAT)

    with ThreadPoolExecutor(4) as pool:  # batched decode: several grammars masked in one step
        answers = list(pool.map(ask, PEOPLE))
    texts = [r.choices[0].message.content for r in answers]
    assert [r.choices[0].finish_reason for r in answers] == ["stop"] * len(PEOPLE), texts
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(texts)) > len(PEOPLE) // 2, texts  # the answers follow the prompts, not one fixed text


def test_streaming_gives_the_non_streaming_answer_and_json_object_gives_an_object(server):
    c = server.client()
    msgs = [{"role": "user", "content": "Describe a pianist from Vienna as JSON."}]
    whole = ask_greedy(c, msgs, max_tokens=300, response_format=FORMAT).choices[0].message.content
    streamed = "".join(ch.choices[0].delta.content or "" for ch in
                       ask_greedy(c, msgs, max_tokens=300, response_format=FORMAT, stream=True) if ch.choices)
    assert streamed == whole
    free = ask_greedy(c, [{"role": "user", "content": "List three fruits as a JSON object."}], max_tokens=120,
                      response_format={"type": "json_object"})
    assert isinstance(json.loads(free.choices[0].message.content), dict)


def test_a_schema_with_an_unenforceable_keyword_is_a_400_naming_it_and_nothing_is_stored(server):
    c = server.client()
    before = server.query(MESSAGE_COUNT)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "not": {"required": ["a"]}}}}
    with pytest.raises(openai.BadRequestError, match='"not"') as err:
        ask_greedy(c, [{"role": "user", "content": "Hi"}], max_tokens=4, response_format=bad)
    body = err.value.body
    assert body["param"] == "response_format" and body["type"] == "invalid_request_error", body
    assert server.query(MESSAGE_COUNT) == before
