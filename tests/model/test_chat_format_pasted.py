"""A pasted document in a user message: where its part ends in the ids, and that the part's ids do not depend
on the question after it (SmolLM2's tokenizer and template, and the Qwen3-style template of tests/data)."""

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from kvchat.model.chat_format import PASTED_DOCUMENT_TOKENS, ChatFormat

pytestmark = pytest.mark.model
TEMPLATES = Path(__file__).parents[1] / "data" / "templates"
DOC = "\n\n".join(f"Section {i}. The river Alder passes mill {i * 7}; its miller keeps {i + 3} cats and a grain "
                  "ledger." for i in range(24))
QUESTIONS = ["\n\nWhat does the miller keep?", "\n\nWhich mill is number 21?\n\nAnswer in one line.",
             "   \n \n\tHow many sections are there?"]


@pytest.fixture(scope="module", params=[None, "qwen3.jinja"])
def fmt(request, smol_dir):
    tok = AutoTokenizer.from_pretrained(smol_dir)
    if request.param:
        tok.chat_template = (TEMPLATES / request.param).read_text()
    return ChatFormat(tok, date_string="26 Jul 2024")


def test_the_document_part_has_the_same_ids_whatever_question_follows(fmt):
    turns = [fmt.user_turn(DOC + q) for q in QUESTIONS]
    end = turns[0].document_end
    assert end is not None and turns[2].document_end == end
    # a question of two paragraphs: its first one counts as part of the document, which still starts
    # with the same ids, so the first request's snapshot (its tail at `end`) prefixes this one too
    assert turns[1].document_end > end
    assert all(t.ids[:end] == turns[0].ids[:end] for t in turns)
    assert turns[0].document_chars == len(DOC)
    # the part ends right after the document's last characters: the question's first words come after it
    assert fmt.decode(turns[0].ids[:end]).endswith("grain ledger.")
    assert "miller keep" in fmt.decode(turns[0].ids[end:])
    assert all(t.question for t in turns)
    # the split is token-neutral for this tokenizer: the ids are those of encoding the whole rendered message
    assert all(t.ids == whole_ids(fmt, DOC + q) for t, q in zip(turns, QUESTIONS))


def whole_ids(fmt, text: str) -> list[int]:
    """Ids of the user turn's rendering encoded in one piece (no special-token strings in ``text``)."""
    return fmt._encode("".join(fmt._frame(fmt._after_assistant, {"role": "user", "content": text}, True)))


def test_crlf_paragraph_breaks_split_like_lf(fmt):
    crlf = DOC.replace("\n", "\r\n") + "\r\n\r\nWhat does the miller keep?"
    t = fmt.user_turn(crlf)
    assert t.question and t.document_chars == len(DOC.replace("\n", "\r\n"))
    assert fmt.decode(t.ids[:t.document_end]).endswith("grain ledger.")
    assert t.ids == whole_ids(fmt, crlf)


def test_the_threshold_is_one_disk_chunk_and_a_long_message_is_encoded_about_once(fmt):
    from kvchat.engine.persistence import CHUNK_TOKENS

    assert PASTED_DOCUMENT_TOKENS == CHUNK_TOKENS
    assert fmt._split_at_breaks  # SmolLM2's tokenizer merges nothing across a blank line
    tok, chars = fmt._tokenizer, []
    encode = tok.encode
    tok.encode = lambda text, **kw: chars.append(len(text)) or encode(text, **kw)
    try:
        text = DOC + "\n\nWhat does the miller keep?"
        assert fmt.user_turn(text).question
        long_chars = sum(chars)
        chars.clear()
        fmt.user_turn("x" * (PASTED_DOCUMENT_TOKENS - 1))  # under the threshold in bytes: one encode, no split
        short_calls = len(chars)
    finally:
        del tok.encode
    assert long_chars < 1.1 * len(text), (long_chars, len(text))  # was ~3x: the whole, the part, the part again
    assert short_calls == 3  # template text before, the literal run, template text after


def test_a_whole_message_document_and_short_messages(fmt):
    alone = fmt.user_turn(DOC)  # no question: the part is up to the last paragraph break (still a document)
    assert alone.document_end is not None and alone.document_chars == DOC.rindex("\n\nSection 23")
    assert alone.question  # the last paragraph counts as the question
    short = "Summarize:\n\n" + "word " * 20
    assert fmt.user_turn(short).document_end is None and fmt.user_turn(short).document_chars == 0
    # a short last-paragraph split would leave a part under the threshold: the whole message is the part
    long_q = "Summarize this.\n\n" + DOC.replace("\n\n", " ")
    t = fmt.user_turn(long_q)
    assert t.document_chars == len(long_q) and not t.question
    assert t.ids == whole_ids(fmt, long_q)
    assert len(fmt._encode_literal(long_q)) >= PASTED_DOCUMENT_TOKENS
