"""A second conversation pasting the same document, sent the moment the first answer arrives (a real
``kvchat serve`` process, the real ``openai`` client), reuses the whole document part: the pool's whole blocks,
then the tail from the first chat's snapshot, whose writes may still be queued when the request arrives."""

from __future__ import annotations

import pytest
from process_helpers import run_kvchat
from server_helpers import MODEL, Server

pytestmark = pytest.mark.model
SYSTEM = {"role": "system", "content": "You are a concise assistant."}
# about 1,500 tokens: the document part ends inside its third 512-token prefill chunk, off a 16-token block
DOC = "\n\n".join(f"Entry {i}. The ferry from pier {i * 3} to the island of {['Ash', 'Bree', 'Cole'][i % 3]} "
                  f"leaves at {i % 12 + 1} o'clock and carries {i * 11 % 40 + 2} bicycles." for i in range(44))


def _ask(client, question: str, max_tokens: int):
    return client.chat.completions.create(model=MODEL, temperature=0, max_tokens=max_tokens,
                                          messages=[SYSTEM, {"role": "user", "content": DOC + "\n\n" + question}])


def test_second_question_on_a_pasted_document_back_to_back_reuses_all_of_it(tmp_path, smol_info):
    home = tmp_path / "home"
    srv = Server(home).start()
    try:
        c = srv.client()
        first = _ask(c, "When does the ferry from pier 9 leave?", 24)
        second = _ask(c, "How many bicycles does entry 5 carry?", 2)  # at once, as the first answer arrives
        out = run_kvchat(home, "doc", "list")
        assert out.returncode == 0, out.stderr
        (pasted,) = [int(line.split()[1]) for line in out.stdout.splitlines()[1:]]
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert pasted % 16 and pasted % 512 > 16  # the case where the pool alone stops short of the part's end
        k = second.model_extra["kvchat"]
        # the README's promise: the whole document part (the pool to its last 16-token block, the tail from disk)
        assert second.usage.prompt_tokens_details.cached_tokens >= pasted, k
        assert k["from_memory"] >= pasted - 16 and k["from_disk"] > 0, k
    finally:
        srv.stop()
