"""The retrieval probe's chats (no model run): the fact sits at the asked depth, exactly once, and the
scored tokens are exactly the value's tokens, after the question."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from kvchat.bench.retrieval import FACT, FACT_VALUE, QUESTION, build_probe, filler_document, plant
from kvchat.model.chat_format import ChatFormat
from kvchat.texts import stdlib_text


@pytest.fixture(scope="module")
def tok(smol_dir):
    return AutoTokenizer.from_pretrained(str(smol_dir))


@pytest.mark.parametrize("depth", [0.1, 0.5, 0.9])
def test_fact_planted_at_the_depth_once(tok, depth):
    paragraphs = filler_document(tok, stdlib_text().text, 4096)
    doc, before = plant(paragraphs, depth, tok)
    assert doc.count(FACT) == 1
    total = len(tok.encode("\n\n".join(paragraphs), add_special_tokens=False))
    assert abs(before / total - depth) < 0.05, "the fact is not where the probe says it is"
    head = doc[: doc.index(FACT)].rstrip("\n")
    assert len(tok.encode(head, add_special_tokens=False)) == before


def test_scored_tokens_are_the_value_after_the_question(tok):
    fmt = ChatFormat(tok, date_string="01 Jan 2025")
    paragraphs = filler_document(tok, stdlib_text().text, 512)
    probe = build_probe(fmt, tok, paragraphs, 0.5, "You are helpful.")
    control = build_probe(fmt, tok, paragraphs, None, "You are helpful.")
    assert tok.decode(probe.ids[probe.value_start:]).strip() == FACT_VALUE
    assert QUESTION in tok.decode(probe.ids[probe.boundaries[1]:probe.boundaries[2]])
    assert FACT in tok.decode(probe.ids[: probe.boundaries[1]]) and FACT not in tok.decode(control.ids)
    assert probe.ids[probe.value_start:] == control.ids[control.value_start:], "both score the same answer ids"
    assert abs(len(tok.encode("\n\n".join(paragraphs), add_special_tokens=False)) - 512) <= 2
