"""Template drift: a resent history maps each answer kvchat generated back to the exact ids it produced.

Real tokenizer (SmolLM2's) with SmolLM2's own template and with the Qwen3-style
template in tests/data/templates (it strips ``<think>`` blocks from history);
a real SQLite index holds the stored chat the answers are looked up in.
"""

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from kvchat.conversation.history_match import generated_answer, strip_think
from kvchat.index import get_db
from kvchat.model.chat_format import ChatFormat
from kvchat.server.prefix import render
from kvchat.store.conversations import NewMessage, append_turn, create_conversation

TEMPLATES = Path(__file__).parents[1] / "data" / "templates"
FP = "model-fp"
SYSTEM = "You are terse."


def _tok(smol_dir, template=None):
    tok = AutoTokenizer.from_pretrained(smol_dir)
    if template:
        tok.chat_template = (TEMPLATES / template).read_text()
    return tok


def _store_chat(fmt, user, generated, text):
    """A chat as kvchat stores one: prefix, user turn, the generated ids + closing ids with their text."""
    db = get_db()
    conv = create_conversation(db, title=user, model_fingerprint=FP)
    prefix, turn = fmt.prefix_ids(SYSTEM, []), fmt.user_turn_ids(user)
    v = append_turn(db, conv.id, prefix, [], segment_kind="prefix")
    v = append_turn(db, conv.id, turn, [NewMessage("user", user, 0, len(turn))], segment_kind="user", expected_version=v)
    answer = generated + fmt.assistant_close_ids(generated[-1] if generated[-1] in fmt.stop_token_ids else None)
    append_turn(db, conv.id, answer, [NewMessage("assistant", text, 0, len(answer))], segment_kind="assistant",
                expected_version=v)
    return prefix + turn + answer


def _lookup(ids, text):
    return generated_answer(ids, text, FP)


def test_smollm2_resent_answer_maps_to_generated_ids(smol_dir):
    tok = _tok(smol_dir)
    fmt = ChatFormat(tok, date_string="26 Jul 2024")
    generated = [i for piece in ("Par", "is.", "\n", "\nIt is big") for i in tok.encode(piece, add_special_tokens=False)]
    text = tok.decode(generated)
    generated += [tok.eos_token_id]
    assert fmt.assistant_text_ids(text)[:-2] != generated[:-1], "the answer must re-tokenize differently"
    stored = _store_chat(fmt, "Capital of France?", generated, text)
    r = render(fmt, SYSTEM, [("Capital of France?", text)], _lookup)
    assert r.token_ids == stored and r.drift is None
    assert r.history[0][2] == stored[len(stored) - len(r.history[0][2]):]

    other = render(fmt, SYSTEM, [("Capital of France?", text + " city")], _lookup)
    start = len(fmt.prefix_ids(SYSTEM, [])) + len(fmt.user_turn_ids("Capital of France?"))
    assert other.token_ids[:start] == stored[:start] and other.token_ids != stored
    assert other.drift is not None and f"assistant message 1 (token {start})" in other.drift


@pytest.mark.parametrize("resent", ["full", "think stripped"])
def test_qwen3_history_without_think_block_still_matches(smol_dir, resent):
    tok = _tok(smol_dir, "qwen3.jinja")
    fmt = ChatFormat(tok, template_kwargs={"enable_thinking": False})
    text = "<think>\nThe user wants a city.\n</think>\n\nParis."
    generated = tok.encode(text, add_special_tokens=False) + [fmt.stop_token_ids.copy().pop()]
    stored = _store_chat(fmt, "Capital of France?", generated, text)
    sent = text if resent == "full" else strip_think(text)
    assert strip_think(text) == "Paris."
    # before a later user message the template renders the answer without its think block: a whole-list
    # rendering of the resent history would miss the cached ids
    whole = tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Capital of France?"},
                                     {"role": "assistant", "content": sent}, {"role": "user", "content": "Why?"}],
                                    tokenize=False, enable_thinking=False)
    assert "The user wants a city" not in whole
    r = render(fmt, SYSTEM, [("Capital of France?", sent)], _lookup)
    assert r.token_ids == stored and r.drift is None


def test_an_answer_is_found_among_more_than_eight_chats_sharing_its_prefix(smol_dir):
    tok = _tok(smol_dir)
    fmt = ChatFormat(tok, date_string="26 Jul 2024")
    generated = [i for piece in ("Par", "is.", "\n", "\nIt is big") for i in tok.encode(piece, add_special_tokens=False)]
    text = tok.decode(generated)
    stored = _store_chat(fmt, "Capital of France?", generated + [tok.eos_token_id], text)  # the oldest of 12
    for k in range(11):  # newer chats with the same prefix and user turn, other answers
        other = f"Answer number {k}."
        _store_chat(fmt, "Capital of France?", tok.encode(other, add_special_tokens=False) + [tok.eos_token_id], other)
    r = render(fmt, SYSTEM, [("Capital of France?", text)], _lookup)
    assert r.token_ids == stored and r.drift is None
