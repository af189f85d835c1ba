"""The arithmetic of going on from a full chat: what each way carries, on the real context, and the lines."""

from __future__ import annotations

from kvchat.conversation.continuation import ANSWER_ROOM_TOKENS, Continuation, answer_room
from kvchat.conversation.views import ContextFullError


def full_gpl_chat(message: int = 5) -> Continuation:
    """A chat on an 8,192-token context: 7,701 tokens of system prompt and documents, one turn of 482."""
    return Continuation("c_1", 8192, 7701, 30, 1, (482,), message, answer_room(512))


def test_documents_that_leave_no_room_offer_the_two_other_ways_with_the_numbers():
    plan = full_gpl_chat()
    assert plan.answer == ANSWER_ROOM_TOKENS == 256 and plan.room == 261
    assert not plan.fits("all") and plan.carried_turns("all") == 0
    assert plan.offered() == ["turns", "documents"]
    assert plan.choice_text("turns") == "the last turn, without the documents: 512 of 8,192 tokens"
    assert plan.choice_text("documents") == "the documents alone: 7,701 of 8,192 tokens"
    assert plan.no_room_line() == ("the system prompt and documents are 7,701 of 8,192 tokens: the last turn "
                                   "(482 tokens) does not fit beside them with room for the message (5 tokens) "
                                   "and an answer of 256")
    hint = plan.full_hint("--new-chat ")
    assert "--new-chat turns (" in hint and "--new-chat documents (" in hint and "--new-chat all" not in hint
    error = plan.error("all", "--new-chat ")
    assert isinstance(error, ContextFullError) and error.limit == 8192 and error.needed == 7701 + 482 + 261
    assert str(error).startswith("--new-chat all does not fit: the system prompt and documents are 7,701")


def test_all_carries_as_many_last_turns_as_fit_on_the_whole_context():
    # 2,000 of prefix, turns of 3,000 / 2,500 / 2,500 / 2,000: the last three would need 2,000 + 7,000 + room
    plan = Continuation("c_1", 8192, 2000, 30, 1, (3000, 2500, 2500, 2000), 10, answer_room(512))
    assert plan.carried_turns("all") == 2 and plan.tokens("all") == 6500 <= 8192 - plan.room
    assert plan.offered() == ["all"]
    assert plan.describe("all") == "the documents and the last 2 turns"
    assert plan.carried_turns("turns") == 3  # without the documents, one more fits
    assert plan.full_hint("--new-chat ") == ("continue in a new chat with --new-chat all (the documents and the "
                                             "last 2 turns: 6,500 of 8,192 tokens)")


def test_room_is_the_message_and_the_smaller_of_max_tokens_and_the_stated_minimum():
    assert answer_room(8) == 8 and answer_room(10_000) == ANSWER_ROOM_TOKENS
    tight = Continuation("c_1", 256, 198, 30, 1, (23,), 43, answer_room(8))
    assert tight.room == 51 and not tight.fits("all") and tight.offered() == ["turns", "documents"]
    assert tight.carried_turns("turns") == 1 and tight.tokens("turns") == 53


def test_no_way_on_says_so_and_a_chat_without_documents_has_no_turns_way():
    plan = Continuation("c_1", 8192, 8000, 8000, 0, (182,), 5, 256)
    assert plan.offered() == [] and not plan.fits("turns")
    assert plan.full_hint() == ("the system prompt is 8,000 of 8,192 tokens: no room for the message (5 tokens) "
                                "and an answer of 256 even without the turns; no new chat fits")
    assert plan.why_not("turns") == "the chat has no documents to leave out"
    plain = Continuation("c_1", 1000, 20, 20, 0, (300, 300, 300), 0, 100)
    assert plain.offered() == ["all"] and plain.describe("all") == "the system prompt and the last 2 turns"
