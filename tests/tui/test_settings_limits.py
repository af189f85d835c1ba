"""The generation settings dialog takes the ranges the server takes (one set, kvchat.engine.turn.LIMITS): a
value set locally never turns into a 400 on a server."""

from __future__ import annotations

from dataclasses import fields

import pytest

from kvchat.engine.turn import SamplingParams
from kvchat.tui.screens.settings import parse_settings

DEFAULTS = {f.name: "" if getattr(SamplingParams(), f.name) is None else str(getattr(SamplingParams(), f.name))
            for f in fields(SamplingParams)}


@pytest.mark.parametrize("name, value, words", [
    ("temperature", "1e308", "temperature must be in [0, 2]"),
    ("temperature", "2.5", "temperature must be in [0, 2]"),
    ("max_tokens", "99999999999999999999", "max tokens must be in [1, 2147483647]"),
    ("top_k", "4294967296", "top_k must be in [0, 2147483647]"),
])
def test_values_past_the_apis_ranges_are_refused(name, value, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        parse_settings({**DEFAULTS, name: value})


def test_the_edges_of_the_ranges_are_taken():
    params = parse_settings({**DEFAULTS, "temperature": "2", "max_tokens": "2147483647", "presence_penalty": "-2"})
    assert (params.temperature, params.max_tokens, params.presence_penalty) == (2.0, 2**31 - 1, -2.0)
