"""Exporting a chat to a Markdown file."""

from __future__ import annotations

import os
import re
import unicodedata
from pathlib import Path

from kvchat.conversation.views import ChatView


def chat_to_markdown(view: ChatView) -> str:
    """The chat as Markdown: title, system prompt, documents, then each message under a role heading.

    Message text is copied verbatim (it already is Markdown, as the model wrote it).
    """
    lines = [f"# {view.title}", ""]
    if view.system_prompt:
        lines += ["**System prompt:** " + view.system_prompt, ""]
    if view.documents:
        lines += ["**Documents:** " + ", ".join(view.documents), ""]
    for m in view.messages:
        lines += ["## " + ("You" if m.role == "user" else "Assistant"), "", m.text, ""]
    return "\n".join(lines).rstrip() + "\n"


def export_dir(fallback: Path) -> Path:
    """The current directory if writable, else ``fallback`` (created)."""
    cwd = Path.cwd()
    if os.access(cwd, os.W_OK):
        return cwd
    fallback.mkdir(parents=True, exist_ok=True)
    return fallback


def export_chat(view: ChatView, directory: Path) -> Path:
    """Write the chat to ``directory/kvchat-<id>-<title slug>.md`` (replacing an older export); return the path."""
    # letters, their marks (Devanagari's vowel signs, combining accents) and digits of any script are kept, NFC
    # after case folding so that one title gives one name; the rest (separators, punctuation, path characters)
    # become single hyphens
    kept = "".join(c if unicodedata.category(c)[0] in "LMN" else "-" for c in view.title.casefold())
    slug = re.sub("-+", "-", unicodedata.normalize("NFC", kept)).strip("-")[:40].strip("-") or "chat"
    path = directory / f"kvchat-{view.id or 'new'}-{slug}.md"
    path.write_text(chat_to_markdown(view), encoding="utf-8")
    return path
