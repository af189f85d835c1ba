"""``kvchat ask --server`` on a server kvchat did not write: llama.cpp's OpenAI-compatible server
(``llama-cpp-python[server]``) on the default model's GGUF, started here where it is installed.

The same 3-turn conversation works (one chat, stored as text), and the reuse it reports is llama.cpp's
``usage.prompt_tokens_details.cached_tokens`` when it sends that, else a line saying it does not say.
"""

from __future__ import annotations

import importlib.util
import json
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


def test_ask_holds_a_conversation_on_llama_cpps_server(llama_server, kvchat_home):
    outs, chat = [], []
    for text in ("Name a fruit.", "Name a colour.", "Name a tree."):
        proc = run_kvchat(kvchat_home, "ask", "--server", llama_server, "--json", "--max-tokens", "8", text, *chat,
                          timeout=300)
        assert proc.returncode == 0, proc.stderr + proc.stdout
        outs.append(json.loads(proc.stdout))
        chat = ["--chat", outs[0]["chat_id"]]
    assert len({o["chat_id"] for o in outs}) == 1 and all(o["text"] for o in outs)
    assert outs[2]["prompt_tokens"] > outs[1]["prompt_tokens"] > outs[0]["prompt_tokens"] > 0
    last = outs[2]
    assert (last["server_reuse"].startswith("the server reused") and last["reused_tokens"] > 0
            or last["server_reuse"] == "the server does not say which tokens it reused"), last
