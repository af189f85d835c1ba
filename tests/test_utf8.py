"""kvchat.utf8.require_utf8: the one UTF-8 check, on the two ways bad text arrives (PEP 383 bytes, JSON)."""

from __future__ import annotations

import json
import os

import pytest

from kvchat.server.protocol import ApiError, parse_chat_request
from kvchat.utf8 import NotUtf8Error, require_utf8


def test_valid_text_passes_and_bad_text_names_the_byte_or_the_surrogate():
    assert require_utf8("café ✓ 🎉", "x") == "café ✓ 🎉"
    with pytest.raises(NotUtf8Error, match=r"^the prompt is not UTF-8 text \(byte 0xe9 at character 3\)$"):
        require_utf8(os.fsdecode(b"caf\xe9"), "the prompt")
    with pytest.raises(NotUtf8Error, match=r"lone surrogate U\+D800 at character 1"):
        require_utf8(json.loads('"a\\ud800"'), "the prompt")


@pytest.mark.parametrize("content", ['"\\ud800"', '[{"type": "text", "text": "ok \\udfff"}]'], ids=["string", "parts"])
def test_a_request_with_a_lone_surrogate_is_a_400_naming_the_message(content):
    raw = ('{"model": "m", "messages": [{"role": "system", "content": "s"}, '
           f'{{"role": "user", "content": {content}}}]}}').encode()
    with pytest.raises(ApiError) as err:
        parse_chat_request(raw)
    assert err.value.status == 400 and err.value.param == "messages[1]"
    assert err.value.body()["error"]["type"] == "invalid_request_error" and "not UTF-8" in err.value.message

