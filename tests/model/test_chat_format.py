"""Conversations as token ids: prefix property and equality with whole-list rendering, per real template.

SmolLM2's own template (from the imported model) lets our append-only ids equal
``apply_chat_template`` over the whole message list. Llama-3.2 (stamps the date)
and Qwen3 (drops <think> blocks from history) break that; the tests show the break
and what ChatFormat does instead. Their templates are stored under tests/data/templates
(provenance in each file's first comment) and paired with SmolLM2's tokenizer, with
Llama's header tokens added as special tokens as its own tokenizer has them.
"""

from datetime import datetime
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from kvchat.model.chat_format import ChatFormat, ChatTemplateError, Segment, append_segment, document_message

TEMPLATES = Path(__file__).parents[1] / "data" / "templates"
DATE = "26 Jul 2024"
SYSTEM = "You are kvchat. Answer from the documents."
DOCS = [("notes.txt", "PagedAttention stores the KV cache in fixed-size blocks.\n"),
        ("b.md", "Block size is 16 tokens")]


def _tokenizer(smol_dir, template: str | None = None, llama_specials: bool = False):
    tok = AutoTokenizer.from_pretrained(smol_dir)
    if llama_specials:
        tok.add_special_tokens({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                                "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>"]})
    if template is not None:
        tok.chat_template = (TEMPLATES / template).read_text()
    return tok


@pytest.fixture(scope="module")
def smol(smol_dir):
    return _tokenizer(smol_dir)


@pytest.fixture(scope="module")
def llama(smol_dir):
    return _tokenizer(smol_dir, "llama-3.2-instruct.jinja", llama_specials=True)


@pytest.fixture(scope="module")
def qwen3(smol_dir):
    return _tokenizer(smol_dir, "qwen3.jinja")


def _render(tok, messages, gen, **kw):
    return tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **kw),
                      add_special_tokens=False)


def _chat(tok, fmt, turns, docs=DOCS):
    """Build a chat append-only. turns: (user text, generated ids, stop id or None).

    Returns ids, segments, the message list, and (ids after each user turn, ids after each close).
    """
    ids, segments = [], []
    append_segment(ids, segments, "prefix", fmt.prefix_ids(SYSTEM, docs))
    messages = [{"role": "system", "content": SYSTEM}] + [document_message(t, x) for t, x in docs]
    snapshots = []
    for user, generated, stop in turns:
        append_segment(ids, segments, "user", fmt.user_turn_ids(user))
        after_user = list(ids)
        append_segment(ids, segments, "assistant", generated)
        append_segment(ids, segments, "assistant", fmt.assistant_close_ids(stop))
        snapshots.append((after_user, list(ids)))
        text = tok.decode([i for i in generated if i != stop])
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": text}]
    return ids, segments, messages, snapshots


def test_smollm2_incremental_ids_equal_whole_render(smol):
    fmt = ChatFormat(smol, date_string=DATE)
    eos = smol.eos_token_id
    turns = [("What does PagedAttention store?", smol.encode("The KV cache, in blocks.") + [eos], eos),
             ("How big is a block?", smol.encode("16 tokens"), None),  # cancelled: full close appended
             ("Thanks!\n", smol.encode("You're welcome.") + [eos], eos)]
    ids, segments, messages, snapshots = _chat(smol, fmt, turns)
    for n, (after_user, after_close) in enumerate(snapshots):
        history = messages[:1 + len(DOCS) + 2 * n]
        assert after_user == _render(smol, history + [messages[len(history)]], True)
        assert after_close == _render(smol, messages[:len(history) + 2], False)
        if n + 1 < len(snapshots):
            assert snapshots[n + 1][0][:len(after_close)] == after_close  # prefix property, turn n -> n+1
    assert [s.kind for s in segments] == ["prefix"] + ["user", "assistant"] * 3
    assert [(a.end, b.start) for a, b in zip(segments, segments[1:])] == [(a.end, a.end) for a in segments[:-1]]
    assert segments[0].start == 0 and segments[-1].end == len(ids)
    assert fmt.stop_token_ids == {eos}
    assert smol.decode(fmt.assistant_close_ids(None)) == "<|im_end|>\n"
    assert smol.decode(fmt.assistant_close_ids(eos)) == "\n"


_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(system=_text, docs=st.lists(st.tuples(_text, _text), max_size=3), users=st.lists(_text, min_size=1, max_size=3))
def test_smollm2_any_text_matches_whole_render(smol, system, docs, users):
    fmt = ChatFormat(smol, date_string=DATE)
    ids = fmt.prefix_ids(system, docs)
    messages = [{"role": "system", "content": system}] + [document_message(t, x) for t, x in docs]
    for k in range(len(docs)):
        assert fmt.prefix_ids(system, docs[:k]) == ids[:len(fmt.prefix_ids(system, docs[:k]))]
    for user in users:
        ids += fmt.user_turn_ids(user) + smol.encode("Ok.") + fmt.assistant_close_ids(None)
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": "Ok."}]
    assert ids == _render(smol, messages, False)


def test_generated_ids_are_kept_not_retokenized(smol):
    fmt = ChatFormat(smol, date_string=DATE)
    word = smol.encode("Hello")
    generated = [smol.convert_tokens_to_ids(c) for c in "Hello"]  # a valid but non-canonical split
    assert len(word) == 1 and len(generated) == 5
    ids, segments, messages, _ = _chat(smol, fmt, [("hi", generated + [smol.eos_token_id], smol.eos_token_id)])
    assistant = segments[-1]
    assert ids[assistant.start:assistant.end] == generated + [smol.eos_token_id] + smol.encode("\n")
    assert ids != _render(smol, messages, False)  # re-rendering would have re-tokenized "Hello"


def test_documents_are_sealed_shared_and_deterministic(smol):
    fmt = ChatFormat(smol, date_string=DATE)
    one = fmt.prefix_ids(SYSTEM, DOCS[:1])
    two = fmt.prefix_ids(SYSTEM, DOCS)
    assert two[:len(one)] == one  # a chat on [a, b] shares the whole [a] prefix
    assert ChatFormat(smol, date_string=DATE).prefix_ids(SYSTEM, DOCS) == two
    whole = [{"role": "system", "content": SYSTEM}] + [document_message(t, x) for t, x in DOCS]
    assert two == _render(smol, whole, False)
    end = smol.convert_tokens_to_ids("<|im_end|>")
    # the doc text "...blocks.\n" ends in a newline; the seal follows it, unmerged
    assert one[-2:] == [end] + smol.encode("\n")
    assert smol.decode(two).count("<|im_end|>") == 1 + len(DOCS)
    assert smol.decode(one[:-2]).endswith("fixed-size blocks.\n")


def test_smollm2_default_system_prompt_never_injected(smol):
    injected = smol.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "You are a helpful AI assistant named SmolLM" in injected  # what the template does on its own
    fmt = ChatFormat(smol, date_string=DATE)
    ids = fmt.prefix_ids("", []) + fmt.user_turn_ids("hi")
    assert "SmolLM" not in smol.decode(ids)
    assert ids == _render(smol, [{"role": "system", "content": ""}, {"role": "user", "content": "hi"}], True)


def test_llama32_date_is_pinned_per_chat(llama):
    today = datetime.now().strftime("%d %b %Y")
    unpinned = llama.apply_chat_template([{"role": "system", "content": SYSTEM}], tokenize=False)
    assert f"Today Date: {today}" in unpinned  # the break: tomorrow this prefix differs
    assert ChatFormat(llama).date_string == today
    fmt = ChatFormat(llama, date_string=DATE)
    assert f"Today Date: {DATE}" in llama.decode(fmt.prefix_ids(SYSTEM, DOCS))
    assert ChatFormat(llama, date_string=DATE).prefix_ids(SYSTEM, DOCS) == fmt.prefix_ids(SYSTEM, DOCS)
    assert ChatFormat(llama, date_string="27 Jul 2024").prefix_ids(SYSTEM, DOCS) != fmt.prefix_ids(SYSTEM, DOCS)
    eot = llama.eos_token_id
    turns = [("Question one?", llama.encode("Answer one.") + [eot], eot), ("Two?", llama.encode("Two."), None)]
    ids, _, messages, snapshots = _chat(llama, fmt, turns)
    assert fmt.stop_token_ids == {eot} and fmt.assistant_close_ids(eot) == []
    assert llama.decode(fmt.user_turn_ids("hi")) == ("<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
                                                     "<|start_header_id|>assistant<|end_header_id|>\n\n")
    whole = llama.apply_chat_template(messages, tokenize=False, date_string=DATE)
    assert llama.decode(ids) == whole
    # SmolLM2's pre-tokenizer makes the generation prompt's final "\n\n" one token when it ends the
    # text, but two when "Answer" follows; the model saw the former, and ids are never re-tokenized
    nn = llama.encode("\n\n")
    assert len(nn) == 1 and ids.count(nn[0]) > _render(llama, messages, False, date_string=DATE).count(nn[0])
    assert snapshots[1][0][:len(snapshots[0][1])] == snapshots[0][1]


def test_template_stamping_the_clock_is_refused(smol):
    tok = AutoTokenizer.from_pretrained(smol.name_or_path)
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if loop.first %}"
                         "{{ strftime_now('%Y-%m-%d') }} {% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(ChatTemplateError, match="stamps the current date"):
        ChatFormat(tok, date_string=DATE)


def _qwen_history(tok, fmt, answer):
    eos = tok.eos_token_id
    return _chat(tok, fmt, [("Capital of France?", tok.encode(answer) + [eos], eos), ("And Spain?", [], None)],
                 docs=[])


def test_qwen3_think_blocks_are_kept_though_the_template_drops_them(qwen3):
    fmt = ChatFormat(qwen3, date_string=DATE)
    answer = "<think>\nThe user asks a capital.\n</think>\n\nParis."
    ids, _, messages, snapshots = _qwen_history(qwen3, fmt, answer)
    turn1, turn2 = messages[:3], messages[:4]
    # the break: the template's own rendering of turn 1 is not a prefix of turns 1..2
    closed = qwen3.apply_chat_template(turn1, tokenize=False)
    nxt = qwen3.apply_chat_template(turn2, tokenize=False, add_generation_prompt=True)
    assert "<think>" in closed and "<think>" not in nxt and not nxt.startswith(closed)
    # ours: append-only, think block kept, turn 2 cut from the skeleton
    assert snapshots[1][0][:len(snapshots[0][1])] == snapshots[0][1]
    assert snapshots[0][1] == qwen3.encode(closed)
    expected = (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nCapital of France?<|im_end|>\n"
                f"<|im_start|>assistant\n{answer}<|im_end|>\n<|im_start|>user\nAnd Spain?<|im_end|>\n"
                "<|im_start|>assistant\n")
    assert snapshots[1][0] == qwen3.encode(expected)
    assert fmt.user_turn_ids("And Spain?") == qwen3.encode(expected[expected.rindex("<|im_start|>user"):])


def test_qwen3_reasoning_policy_fixed_per_chat(qwen3):
    fmt = ChatFormat(qwen3, date_string=DATE, template_kwargs={"enable_thinking": False})
    empty_think = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert qwen3.decode(fmt.user_turn_ids("hi")).endswith(empty_think)
    assert not qwen3.decode(ChatFormat(qwen3, date_string=DATE).user_turn_ids("hi")).endswith(empty_think)
    ids, _, messages, snapshots = _qwen_history(qwen3, fmt, "Paris.")
    text = qwen3.decode(snapshots[1][0])
    assert text.count(empty_think) == 2  # turn 1's empty think block stays in history
    whole = qwen3.apply_chat_template(messages[:4], tokenize=False, add_generation_prompt=True,
                                      enable_thinking=False)
    assert whole.count(empty_think) == 1 and whole != text  # the template drops it on re-render


@pytest.mark.parametrize("template, match", [
    (None, "no chat template"),
    ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
     "{% if add_generation_prompt %}assistant:{% endif %}", "special token"),
    # Mistral-v0.3 style: the system prompt goes into the last user message
    ("{% for m in messages if m.role != 'system' %}{% if m.role == 'user' %}<|im_start|>{% if loop.last %}"
     "{{ messages[0].content }}\n\n{% endif %}{{ m.content }}<|im_end|>{% else %}{{ m.content }}"
     "<|endoftext|>{% endif %}{% endfor %}", "verbatim"),
])
def test_unusable_templates_are_refused(smol, template, match):
    tok = AutoTokenizer.from_pretrained(smol.name_or_path)
    tok.chat_template = template
    with pytest.raises(ChatTemplateError, match=match):
        ChatFormat(tok, date_string=DATE)


def test_close_after_other_stop_token_and_bad_stop(smol):
    endoftext = smol.convert_tokens_to_ids("<|endoftext|>")
    fmt = ChatFormat(smol, date_string=DATE, extra_stop_ids=[endoftext])
    assert fmt.stop_token_ids == {smol.eos_token_id, endoftext}
    assert fmt.assistant_close_ids(endoftext) == fmt.assistant_close_ids(None) == smol.encode("<|im_end|>\n")
    with pytest.raises(ValueError, match="not a stop token"):
        fmt.assistant_close_ids(smol.encode("a")[0])


def test_append_segment():
    ids, segments = [], []
    append_segment(ids, segments, "prefix", [1, 2])
    append_segment(ids, segments, "user", [3])
    append_segment(ids, segments, "assistant", [4, 5])
    append_segment(ids, segments, "assistant", [6])
    assert ids == [1, 2, 3, 4, 5, 6]
    assert segments == [Segment("prefix", 0, 2), Segment("user", 2, 3), Segment("assistant", 3, 6)]
    with pytest.raises(ValueError, match="segment kind"):
        append_segment(ids, segments, "tool", [7])
