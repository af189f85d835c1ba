"""Export file names: the title's words in any script, nothing that leaves the export directory."""

from __future__ import annotations

import pytest

from kvchat.conversation.views import ChatView
from kvchat.tui.export import export_chat


def _view(title: str) -> ChatView:
    return ChatView(id="c7", title=title, system_prompt="", documents=[], messages=[], num_tokens=0, context_limit=8192)


@pytest.mark.parametrize("title,name", [
    ("Café über naïve", "kvchat-c7-café-über-naïve.md"),
    ("日本語のチャット", "kvchat-c7-日本語のチャット.md"),
    ("Ελληνικά: δοκιμή!", "kvchat-c7-ελληνικά-δοκιμή.md"),
    ("../../etc/passwd", "kvchat-c7-etc-passwd.md"),
    ("Cafe\u0301 (decomposed)", "kvchat-c7-café-decomposed.md"),
    ("___ !!! ___", "kvchat-c7-chat.md"),
    ("a" * 39 + " b", "kvchat-c7-" + "a" * 39 + ".md"),
    ("हिन्दी नोट्स", "kvchat-c7-हिन्दी-नोट्स.md"),  # vowel signs and viramas are marks, not separators
    ("ǰournal", "kvchat-c7-ǰournal.md"),  # casefolds to j + caron: composed again
])
def test_export_name_keeps_the_title_words(tmp_path, title, name):
    path = export_chat(_view(title), tmp_path)
    assert path.name == name and path.parent == tmp_path and path.read_text(encoding="utf-8").startswith(f"# {title}\n")
