"""Parts of ``kvchat bench resume`` that can be wrong without the benchmark noticing: the chat it
builds (exact length, well-formed turns, the same ids in every process) and the page-cache drop."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvchat.bench.page_cache import drop_file_cache, kept_pages_warning, read_file, resident_fraction, write_random_file
from kvchat.bench.resume import build_conversation, dropped_restore_verdicts, process_line, summarise
from kvchat.model.chat_format import ChatFormat
from kvchat.texts import stdlib_text


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


def test_drop_file_cache_evicts_pages_or_reports_what_it_kept(tmp_path):
    fs = _fs_type(tmp_path)
    if fs in ("tmpfs", "ramfs"):
        pytest.skip("tmpfs pages live only in the page cache; nothing to drop")
    path = tmp_path / "blob.bin"
    write_random_file(path, 4 << 20)
    if resident_fraction(path) is None:
        pytest.skip("mincore is not available here")
    nbytes, seconds = read_file(path)
    assert nbytes == 4 << 20 and seconds > 0
    assert resident_fraction(path) == 1.0
    left = drop_file_cache(path)
    assert left == resident_fraction(path), "the drop returns the residency it left behind"
    if left != 0.0:
        # Some file systems (network, FUSE, some container overlays) ignore POSIX_FADV_DONTNEED; the
        # benchmarks then print kept_pages_warning instead of passing page-cache reads off as disk reads.
        pytest.skip(f"this {fs or 'unknown'} file system kept {left:.0%} of the pages after POSIX_FADV_DONTNEED")
    time.sleep(0.2)  # readahead that a probe had started would land by now (it did with RWF_NOWAIT probes)
    assert resident_fraction(path) == 0.0, "probing residency brought pages back"
    read_file(path)
    assert resident_fraction(path) == 1.0
    os.unlink(path)


def test_kept_pages_warning_only_when_a_drop_left_pages():
    assert kept_pages_warning([0.0, None, 0.0]) is None
    assert kept_pages_warning([]) is None
    line = kept_pages_warning([0.0, 0.25, None, 1.0])
    assert "kept up to 100%" in line and "\n" not in line


def _summary(n: int, dropped_ms: float, disk: dict) -> dict:
    resumes = {mode: [{"restore_ms": ms, "ttft_ms": ms + 200, "bytes_read": 12242 * n, "resident_before": 0.0,
                       "load_ms": 900.0, "peak_rss_bytes": 700 << 20}]
               for mode, ms in (("warm", 40.0), ("dropped", dropped_ms))}
    build = {"cold_prefill_ms": 14000.0, "snapshot_bytes": 12242 * n, "snapshot_files": 2, "f16_bytes": 23040 * n,
             "ttft_in_memory_ms": 150.0, "question_tokens": 15, "load_ms": 1500.0, "peak_rss_bytes": 900 << 20,
             "decode_tok_s": 12.5}
    return summarise({"tokens": n, "builds": [build], "resumes": resumes}, disk)


def test_summary_carries_every_child_process_load_time_and_the_peak_resident_set():
    disk = {"cold_bytes_per_s": {"median": 1e9}, "hot_bytes_per_s": {"median": 3e9}}
    s = _summary(4096, 50.0, disk)
    assert s["load_ms"]["samples"] == [1500.0, 900.0, 900.0] and s["load_ms"]["max"] == 1500.0
    assert s["peak_rss_bytes"] == s["peak_rss_bytes_chat"] == 900 << 20  # the chat's process, the largest here
    assert s["decode_tok_s"] == 12.5
    assert process_line(s) == ("4096 tokens: load 900 ms (900-1500), peak RSS 0.88 GiB (chat process), 0.88 GiB "
                               "(largest process), decode 12.50 tok/s after the question")


def test_dropped_restore_verdict_uses_the_floor_measured_in_the_run():
    disk = {"cold_bytes_per_s": {"median": 1e9}, "hot_bytes_per_s": {"median": 3e9}}
    floor = 12242 * 4096 / 1e9 * 1e3  # ms to read the snapshot at 1 GB/s
    allowed = 1.5 * floor + 15
    lines = dropped_restore_verdicts([_summary(2048, 500.0, disk), _summary(4096, allowed - 1, disk),
                               _summary(8000, 10 * allowed, disk)])
    assert len(lines) == 2, "only chats of >= 4096 tokens carry the goal"
    assert lines[0].startswith("4096 tokens") and lines[0].endswith(": met") and f"{allowed:.1f} ms" in lines[0]
    assert lines[1].startswith("8000 tokens") and lines[1].endswith(": MISSED")
