"""Every user action once: its key, the screen action it runs, and its palette/help text.

The chat screen's ``BINDINGS``, the command palette and the F1 help screen
are all built from :data:`ACTIONS`, so they cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class Action:
    """``key`` (Textual key name), ``action`` (screen action), ``title`` and ``help`` for palette and help."""

    key: str
    action: str
    title: str
    help: str
    show: bool = False


ACTIONS = (
    Action("f1", "help", "Help", "Show the key bindings", show=True),
    Action("ctrl+n", "new_chat", "New chat", "Start an empty chat", show=True),
    Action("ctrl+o", "attach", "Attach documents", "Start a chat on text files (a cached prefix)", show=True),
    Action("escape", "cancel", "Stop / cancel", "Stop the answer, or a document's prefill"),
    Action("ctrl+r", "regenerate", "Regenerate", "Answer the last message again"),
    Action("f4", "edit_last", "Edit last message", "Rewrite the last message; Enter replaces it"),
    Action("f2", "rename", "Rename chat", "Change the open chat's title"),
    Action("f8", "delete", "Delete chat", "Delete the open chat and its cache"),
    Action("f3", "system_prompt", "System prompt", "Set the system prompt of a new chat"),
    Action("ctrl+g", "settings", "Generation settings", "Temperature, top-p/k, max tokens, seed"),
    Action("ctrl+l", "model", "Model", "Pick the model of the next turns"),
    Action("f9", "copy_last", "Copy last answer", "Copy the last answer to the clipboard"),
    Action("ctrl+s", "export", "Export to Markdown", "Write the open chat to a .md file"),
    Action("f5", "cache", "Cache", "Cache use per chat, pin/unpin, totals", show=True),
    Action("ctrl+f", "search", "Search chats", "Search titles and messages; Enter opens the first match"),
    Action("ctrl+t", "app.change_theme", "Theme", "Pick a Textual theme"),
)

INPUT_KEYS = (
    ("enter", "Send the message"),
    ("ctrl+j", "New line (also shift/alt+enter if the terminal sends them)"),
    ("tab, shift+tab", "Move focus: search, chat list, documents, messages, input"),
    ("tab, ↑ ↓, enter", "Open a stored chat: Tab twice from the input to the chat list (the first stops in the "
                          "search box), Enter (the first if none is picked)"),
    ("↑ ↓ pgup pgdn home end", "Scroll the messages (when focused)"),
    ("ctrl+p", "Command palette (every action above)"),
    ("ctrl+q", "Quit (finishes queued cache writes first)"),
)
