"""The sampler's API hooks (:class:`kvchat.engine.token_rules.TokenRules`) on the logits' device: logit bias,
a real llguidance grammar over a byte-level vocabulary, and log-probabilities (on a GPU too, when there is
one: the mask is built on the host and applied where the logits are)."""

from __future__ import annotations

import json
import math

import llguidance
import pytest
import torch

from kvchat.engine.grammar import Constraint, json_schema_grammar
from kvchat.engine.sampling import Sampler
from kvchat.engine.token_rules import TokenRules
from kvchat.engine.turn import SamplingParams

VOCAB = 257  # the 256 bytes, then the end-of-answer id
EOS = 256
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class _Bytes:
    """A tokenizer whose ids are the bytes (what llguidance's TokenizerWrapper needs)."""

    eos_token_id, bos_token_id = EOS, None
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    special_token_ids = [EOS]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def _constraint(schema: dict) -> Constraint:
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))
    return Constraint(llguidance.LLMatcher(tokenizer, json_schema_grammar(schema).text, log_level=0), VOCAB, "test")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_grammar_makes_random_logits_spell_a_valid_document(device, temperature):
    schema = {"type": "object", "properties": {"ok": {"enum": ["yes", "no"]}, "n": {"type": "integer", "minimum": 0,
                                                                                   "maximum": 99}},
              "required": ["ok", "n"], "additionalProperties": False}
    gen = torch.Generator().manual_seed(3)
    for trial in range(3):
        sampler = Sampler(SamplingParams(temperature=temperature, seed=trial), TokenRules(constraint=_constraint(schema)))
        out = []
        while len(out) < 200:
            token = sampler(torch.randn(VOCAB, generator=gen).to(device) * 5)
            if token == EOS:
                break
            out.append(token)
        doc = json.loads(bytes(out).decode())
        assert doc["ok"] in ("yes", "no") and 0 <= doc["n"] <= 99 and set(doc) == {"ok", "n"}, doc


@pytest.mark.parametrize("device", DEVICES)
def test_logit_bias_and_logprobs_follow_the_openai_definitions(device):
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(1)).to(device)
    top = int(torch.argmax(logits))
    rules = TokenRules(logit_bias={top: -100.0}, top_logprobs=5)
    picked = Sampler(SamplingParams(temperature=0), rules)(logits)
    biased = logits.clone()
    biased[top] -= 100
    assert picked == int(torch.argmax(biased)) != top
    [entry] = rules.logprobs
    expected = torch.log_softmax(biased.float(), -1)
    assert entry.token_id == picked and math.isclose(entry.logprob, float(expected[picked]), abs_tol=1e-5)
    alternatives = [lp for _, lp in entry.top]
    assert len(alternatives) == 5 and alternatives == sorted(alternatives, reverse=True)
    assert entry.top[0][0] == picked and sum(math.exp(lp) for lp in alternatives) <= 1 + 1e-6
    hot = TokenRules(top_logprobs=0)
    Sampler(SamplingParams(temperature=0.5, seed=0), hot)(logits)
    chosen = hot.logprobs[0].token_id
    assert hot.logprobs[0].top == [] and math.isclose(
        hot.logprobs[0].logprob, float(torch.log_softmax(logits.float() / 0.5, -1)[chosen]), abs_tol=1e-5)
