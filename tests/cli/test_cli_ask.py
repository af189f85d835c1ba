"""`kvchat ask` as a user runs it: real subprocesses, the real model, a real data dir."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SEEDS = Path(__file__).resolve().parents[3] / "shared" / "seeds"


def run_cli(args: list[str], home: Path, models: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVCHAT_HOME": str(home), "KVCHAT_MODELS": str(models)}
    return subprocess.run([sys.executable, "-m", "kvchat.cli", *args], capture_output=True, text=True, env=env, timeout=timeout)


def tree(root: Path) -> dict[str, bytes]:
    """Every file under root with its content (to prove nothing changed)."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.endswith(("-wal", "-shm"))}


@pytest.fixture
def models(smol_info) -> Path:
    return smol_info.path.parent


def _bad_inputs(tmp_path: Path) -> list[tuple[list[str], str]]:
    binary = tmp_path / "blob.bin"
    binary.write_bytes(b"\x7fELF\x00\x01\x02" * 100)
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café déjà vu".encode("latin-1"))
    huge = tmp_path / "huge.txt"
    with open(huge, "wb") as f:  # 100 MB sparse file: refused on its size, never read
        f.truncate(100 * 2**20)
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    return [
        (["ask", "hi", "--doc", str(tmp_path / "missing.txt")], "cannot read document"),
        (["ask", "hi", "--doc", str(binary)], "binary"),
        (["ask", "hi", "--doc", str(latin1)], "not UTF-8"),
        (["ask", "hi", "--doc", str(huge)], "the limit is"),
        (["ask", "hi", "--doc", str(empty)], "empty"),
        (["ask", "   "], "prompt is empty"),
        (["ask", "hi", "--chat", "c_nope00"], "no conversation"),
        (["ask", "hi", "--chat", ""], "no conversation with id ''"),  # an empty $ID never starts a new chat
        (["ask", "hi", "--model", "no-such-model"], "unknown model"),
        (["ask", "hi", "--temperature", "-1"], "temperature"),
    ]


def test_bad_input_is_one_line_exit_2_and_changes_nothing(tmp_path, models, kvchat_home):
    # a stored chat first, so "unchanged" covers a real database
    ok = run_cli(["ask", "Say hi.", "--max-tokens", "4", "--json"], kvchat_home, models)
    assert ok.returncode == 0, ok.stderr
    before = tree(kvchat_home)
    assert any(name.endswith(".db") for name in before)
    for args, needle in _bad_inputs(tmp_path):
        r = run_cli(args, kvchat_home, models)
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert r.returncode == 2, (args, r.stderr)
        assert len(lines) == 1 and lines[0].startswith("kvchat: error:") and needle in lines[0], (args, r.stderr)
        assert r.stdout == ""
    assert tree(kvchat_home) == before
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("x")
    r = run_cli(["ask", "hi"], a_file, models)
    assert r.returncode == 2 and r.stderr.strip() == (
        f"kvchat: error: {a_file} is not a directory (check KVCHAT_HOME and KVCHAT_MODELS)")
    # a plain (not --json) resume says why the stored history was recomputed
    chat_id = json.loads(ok.stdout)["chat_id"]
    r = run_cli(["ask", "Again.", "--chat", chat_id, "--kv-dtype", "bf16", "--max-tokens", "2"], kvchat_home, models)
    assert r.returncode == 0, r.stderr
    assert any(line.startswith("kvchat: note: ") and "this run uses bf16" in line for line in r.stderr.splitlines()), r.stderr


def test_context_overflow_names_both_lengths(tmp_path, models, kvchat_home):
    long_doc = tmp_path / "long.txt"
    long_doc.write_text("The quick brown fox jumps over the lazy dog. " * 1200)  # ~12k tokens > 8192
    r = run_cli(["ask", "Summarize.", "--doc", str(long_doc)], kvchat_home, models)
    assert r.returncode == 2
    line = r.stderr.strip()
    assert "context limit is 8192 tokens" in line and "needs" in line
    assert tree(kvchat_home) == {}


@pytest.mark.skipif(not SEEDS.is_dir(), reason="shared/seeds not beside the checkout")
def test_ask_about_a_document_then_continue_the_chat(models, kvchat_home):
    doc = SEEDS / "004_4d805c1dfa684b44.txt"
    first = run_cli(["ask", "What problem does PagedAttention solve?", "--doc", str(doc), "--max-tokens", "24", "--json"],
                    kvchat_home, models)
    assert first.returncode == 0, first.stderr
    a = json.loads(first.stdout)
    for key in ("text", "chat_id", "prompt_tokens", "reused_tokens", "prefilled_tokens", "ttft_ms", "decode_tokens_per_s", "kv_dtype",
                "model"):
        assert key in a
    assert a["kv_dtype"] == "fp8" and a["model"] == "SmolLM2-135M-Instruct"
    assert a["prompt_tokens"] > 4000, "the document is in the prompt"
    assert a["prefilled_tokens"] == a["prompt_tokens"] and a["text"].strip()

    second = run_cli(["ask", "Say it in one sentence.", "--chat", a["chat_id"], "--max-tokens", "8", "--json"], kvchat_home, models)
    assert second.returncode == 0, second.stderr
    b = json.loads(second.stdout)
    assert b["chat_id"] == a["chat_id"]
    assert b["prompt_tokens"] > a["prompt_tokens"] + a["new_tokens"], "history carried over as ids"

    from kvchat.store.conversations import get_conversation
    from kvchat.store.db import connect

    conv = get_conversation(connect(kvchat_home / "kvchat.db"), a["chat_id"])
    assert [m.role for m in conv.messages] == ["user", "assistant", "user", "assistant"]
    assert conv.messages[1].text == a["text"]
    kinds = [k for _, _, k in conv.segments]
    assert kinds == ["prefix", "user", "assistant", "user", "assistant"]
    assert conv.segments[-1][1] == len(conv.token_ids)


def test_threads_beyond_the_usable_cores_are_capped_with_a_note(models, kvchat_home, monkeypatch, capsys):
    from kvchat.cpu_threads import checked_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert checked_threads(2) == 2 and checked_threads(None) is None and capsys.readouterr().err == ""
    assert checked_threads(999) == 2
    assert capsys.readouterr().err == "kvchat: note: --threads 999 capped at 2 usable cores\n"
    with pytest.raises(ValueError, match="--threads must be >= 1, got 0"):
        checked_threads(0)
    monkeypatch.undo()
    cores = len(os.sched_getaffinity(0))
    r = run_cli(["ask", "Say hi.", "--threads", "999", "--max-tokens", "2", "--json"], kvchat_home, models)
    assert r.returncode == 0, r.stderr
    note = f"kvchat: note: --threads 999 capped at {cores} usable core{'s' if cores > 1 else ''}"
    assert note in r.stderr.splitlines(), r.stderr
    assert json.loads(r.stdout)["text"] is not None


def test_a_closed_stdout_stops_quietly_and_keeps_a_stored_turn(models, kvchat_home):
    """``kvchat ask … --json | head -c 5``: the reader goes away before the JSON is written."""
    env = {**os.environ, "KVCHAT_HOME": str(kvchat_home), "KVCHAT_MODELS": str(models)}
    proc = subprocess.Popen([sys.executable, "-m", "kvchat.cli", "ask", "Say hi.", "--json", "--max-tokens", "3",
                             "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    proc.stdout.close()  # nobody reads: the final write gets EPIPE
    err = proc.stderr.read()
    assert proc.wait(timeout=600) == 141, err  # as a shell reports SIGPIPE
    assert "error" not in err and "Traceback" not in err
    from kvchat.index import get_db
    from kvchat.store.conversations import list_conversations

    assert [c.num_messages for c in list_conversations(get_db())] == [2], "the turn was stored before the write"
