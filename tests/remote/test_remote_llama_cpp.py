"""``kvchat ask --server`` on a server kvchat did not write: llama.cpp's OpenAI-compatible server
(``llama-cpp-python[server]``) on the default model's GGUF, started here where it is installed.

The same 3-turn conversation works (one chat, stored as text, each turn sent with its history), and the reuse
kvchat shows is llama.cpp's ``usage.prompt_tokens_details.cached_tokens`` when it sends that, else a line
saying it does not say (llama-cpp-python's server streams no ``usage`` at all: then no token counts either).
"""

from __future__ import annotations

import importlib.util
import json
import sqlite3
import subprocess
import sys
import time
import urllib.request

import pytest
from process_helpers import run_kvchat
from server_helpers import free_port

pytestmark = [pytest.mark.model, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None
                                 or importlib.util.find_spec("llama_cpp.server") is None,
                                 reason="llama-cpp-python[server] is not installed (pip install "
                                        "'llama-cpp-python[server]': it builds llama.cpp from source)")]


@pytest.fixture
def llama_server(tmp_path):
    from kvchat.bench.peers import default_gguf

    port = free_port()
    log = open(tmp_path / "llama-server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(default_gguf()),
                             "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048", "--n_threads", "1"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        assert proc.poll() is None, (tmp_path / "llama-server.log").read_text()
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=2).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "llama.cpp's server did not answer /v1/models"
            time.sleep(0.5)
    yield url
    proc.terminate()
    proc.wait(60)
    log.close()


def streamed_usage(url: str) -> dict:
    """The ``usage`` object of one streamed completion asked for with ``include_usage`` ({} when none came):
    what this server sends, which kvchat shows as it is."""
    import httpx2

    body = {"model": "any", "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    usage: dict = {}
    with httpx2.Client(timeout=120) as http, http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    return usage


def test_ask_holds_a_conversation_on_llama_cpps_server(llama_server, kvchat_home):
    outs, chat = [], []
    for text in ("Name a fruit.", "Name a colour.", "Name a tree."):
        proc = run_kvchat(kvchat_home, "ask", "--server", llama_server, "--json", "--max-tokens", "8", text, *chat,
                          timeout=300)
        assert proc.returncode == 0, proc.stderr + proc.stdout
        outs.append(json.loads(proc.stdout))
        chat = ["--chat", outs[0]["chat_id"]]
    assert len({o["chat_id"] for o in outs}) == 1 and all(o["text"] for o in outs)
    with sqlite3.connect(kvchat_home / "kvchat.db") as conn:
        stored = [r[0] for r in conn.execute("SELECT text FROM messages ORDER BY rowid")]
    assert stored == [x for text, o in zip(("Name a fruit.", "Name a colour.", "Name a tree."), outs)
                      for x in (text, o["text"])], "one chat, stored as text, each turn sent with its history"

    usage = streamed_usage(llama_server)
    if not usage:  # llama-cpp-python's server streams no usage: no token counts, and the reuse line says so
        assert [o["prompt_tokens"] for o in outs] == [0, 0, 0]
        assert all(o["server_reuse"] == "the server does not say which tokens it reused" for o in outs), outs
        return
    assert outs[2]["prompt_tokens"] > outs[1]["prompt_tokens"] > outs[0]["prompt_tokens"] > 0
    last = outs[2]
    if isinstance((usage.get("prompt_tokens_details") or {}).get("cached_tokens"), int):  # shown when sent
        assert last["server_reuse"] == (f"the server reused {last['reused_tokens']:,} cached tokens of "
                                        f"{last['prompt_tokens']:,}"), last
    else:
        assert last["server_reuse"] == "the server does not say which tokens it reused", last
