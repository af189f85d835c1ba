"""The one check that text given to kvchat is valid UTF-8: no lone surrogates.

Text reaches kvchat as ``str`` from three sides: command-line arguments and
file names (Python decodes undecodable bytes to the surrogates U+DC80..U+DCFF,
PEP 383 "surrogateescape"), JSON request bodies (``"\\ud800"`` decodes to a
lone surrogate) and the TUI's input. None of them can be tokenized or stored
as UTF-8, so the CLI, the TUI (through :class:`kvchat.engine.session.Session`)
and the server call :func:`require_utf8` before any work.
"""

from __future__ import annotations

SURROGATE_ESCAPES = range(0xDC80, 0xDD00)  # PEP 383: the undecodable byte 0xXY arrives as U+DCXY


class NotUtf8Error(ValueError):
    """Text that cannot be encoded as UTF-8 (an undecodable byte or a lone surrogate)."""


def require_utf8(text: str, what: str) -> str:
    """Return ``text`` if it encodes as UTF-8.

    ``what`` names the text in the message ("the prompt", "the system prompt", "document file name …").

    Raises:
        NotUtf8Error: one line naming ``what``, the first bad character's offset (characters) and the
            byte it stood for (command line, file names) or the lone surrogate (JSON ``\\uD800``).
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = ord(text[exc.start])
        found = f"byte 0x{bad - 0xDC00:02x}" if bad in SURROGATE_ESCAPES else f"lone surrogate U+{bad:04X}"
        raise NotUtf8Error(f"{what} is not UTF-8 text ({found} at character {exc.start})") from None
    return text
