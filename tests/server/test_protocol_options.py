"""parse_chat_request: option types the OpenAI API defines are checked, not coerced."""

from __future__ import annotations

import pytest

from kvchat.server.protocol import ApiError, parse_chat_request


def test_include_usage_must_be_a_boolean():
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": "yes"}}'
    with pytest.raises(ApiError, match="include_usage must be a boolean"):
        parse_chat_request(raw)
