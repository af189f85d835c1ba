"""Parts of ``kvchat bench resume`` that can be wrong without the benchmark noticing: the chat it
builds (exact length, well-formed turns, the same ids in every process) and the page-cache drop."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvchat.bench.page_cache import drop_file_cache, read_file, resident_fraction, write_random_file
from kvchat.bench.resume import build_conversation
from kvchat.bench.texts import stdlib_text
from kvchat.chat_format import ChatFormat


@dataclass
class TokenizerOnly:
    """What build_conversation uses of a Runtime: the tokenizer and chat formats (no weights loaded)."""

    tokenizer: object

    def chat_format(self, settings: dict | None = None) -> ChatFormat:
        return ChatFormat(self.tokenizer, date_string=(settings or {}).get("date_string"))


@pytest.fixture(scope="module")
def rt(smol_dir):
    from transformers import AutoTokenizer

    return TokenizerOnly(AutoTokenizer.from_pretrained(str(smol_dir)))


@pytest.mark.parametrize("n", [256, 700, 4096])
def test_conversation_is_exactly_n_tokens_of_whole_turns(rt, n):
    text = stdlib_text().text
    ids, segments, settings = build_conversation(rt, n, text)
    assert len(ids) == n
    assert segments[0].start == 0 and segments[-1].end == n
    assert all(a.end == b.start for a, b in zip(segments, segments[1:])), "segments tile the chat"
    kinds = [s.kind for s in segments]
    assert kinds[0] == "prefix" and kinds[1:] == ["user", "assistant"] * ((len(kinds) - 1) // 2)
    close = rt.chat_format(settings).assistant_close_ids(None)
    for s in segments[2::2]:
        assert ids[s.end - len(close):s.end] == close and s.end - s.start > len(close), "every answer is closed"
    assert build_conversation(rt, n, text)[0] == ids, "every process builds the same ids"


def _fs_type(path: Path) -> str:
    best = ("", "")
    for line in Path("/proc/mounts").read_text().splitlines():
        mount, fstype = line.split()[1:3]
        if str(path.resolve()).startswith(mount.rstrip("/") + "/") and len(mount) > len(best[0]):
            best = (mount, fstype)
    return best[1]


def test_drop_file_cache_evicts_pages_and_a_read_brings_them_back(tmp_path):
    if _fs_type(tmp_path) in ("tmpfs", "ramfs"):
        pytest.skip("tmpfs pages live only in the page cache; nothing to drop")
    path = tmp_path / "blob.bin"
    write_random_file(path, 4 << 20)
    if resident_fraction(path) is None:
        pytest.skip("RWF_NOWAIT reads are not supported here")
    nbytes, seconds = read_file(path)
    assert nbytes == 4 << 20 and seconds > 0
    assert resident_fraction(path) == 1.0
    drop_file_cache(path)
    assert resident_fraction(path) == 0.0
    read_file(path)
    assert resident_fraction(path) == 1.0
    os.unlink(path)
