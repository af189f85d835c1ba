"""Showing untrusted text (model output, titles, file names) literally in the terminal.

Textual ``Content`` is never parsed as markup, so ``[bold]`` or ``[link=…]``
stay text; what remains dangerous is control characters (an ``ESC`` in model
output could drive the terminal), so C0 controls other than tab and newline,
and DEL, are replaced by their Unicode "control pictures" (U+2400 block).
"""

from __future__ import annotations

import time

_CONTROL_PICTURES = {c: 0x2400 + c for c in range(0x20) if c not in (0x09, 0x0A)} | {0x7F: 0x2421}


def literal(text: str) -> str:
    """``text`` with control characters other than ``\\t``/``\\n`` made visible (``\\x1b`` -> ``␛``)."""
    return text.translate(_CONTROL_PICTURES)


def one_line(text: str) -> str:
    """:func:`literal`, with newlines and tabs shown as spaces (for titles and list rows)."""
    return literal(text).replace("\n", " ").replace("\t", " ")


def ago(timestamp: float, now: float | None = None) -> str:
    """Age of a Unix timestamp (seconds) as ``just now``, ``5 min``, ``3 h``, ``2 d``."""
    s = max(0.0, (time.time() if now is None else now) - timestamp)
    if s < 60:
        return "just now"
    if s < 3600:
        return f"{s // 60:.0f} min"
    if s < 86400:
        return f"{s // 3600:.0f} h"
    return f"{s // 86400:.0f} d"


def tokens(n: int) -> str:
    """A token count for narrow columns: ``812``, ``3.8k``, ``120k``."""
    if n < 1000:
        return str(n)
    return f"{n / 1000:.1f}k" if n < 100_000 else f"{n // 1000}k"
