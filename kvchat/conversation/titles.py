"""What local and remote chats share without torch: a chat's title, and the error for a chat opened with a
model it was not made with."""

from __future__ import annotations

TITLE_CHARS = 60
UNTITLED = "New chat"  # the title of a chat whose first message has no text


def chat_title(first_message: str) -> str:
    """A chat's title: the first non-blank line of its first user message, at most ``TITLE_CHARS`` characters;
    :data:`UNTITLED` when the message is blank (an API client may send empty content)."""
    line = next((ln.strip() for ln in first_message.splitlines() if ln.strip()), "")
    return line[:TITLE_CHARS] or UNTITLED


class ChatModelMismatchError(ValueError):
    """A stored chat was made with another model (its token ids mean nothing to this one), or is held with a
    server (text only) where a local model opens it, or the other way round."""
