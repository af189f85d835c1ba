"""A chat's title, from its first user message (local and remote chats alike; torch-free)."""

from __future__ import annotations

TITLE_CHARS = 60
UNTITLED = "New chat"  # the title of a chat whose first message has no text


def chat_title(first_message: str) -> str:
    """A chat's title: the first non-blank line of its first user message, at most ``TITLE_CHARS`` characters;
    :data:`UNTITLED` when the message is blank (an API client may send empty content)."""
    line = next((ln.strip() for ln in first_message.splitlines() if ln.strip()), "")
    return line[:TITLE_CHARS] or UNTITLED
