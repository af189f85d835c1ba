"""Sizes for people: one unit system (decimal: kB, MB, GB, TB = 10**3, 10**6, 10**9, 10**12 bytes) in every view.

The CLI, the TUI and every message that names a size of the disk cache or the disk use
:func:`size_text`, so one figure reads the same wherever it is shown (``KVCHAT_CACHE_BUDGET_GB`` is decimal GB too).
"""

from __future__ import annotations

_UNITS = ("B", "kB", "MB", "GB", "TB")


def size_text(n: float) -> str:
    """``n`` bytes as ``512 B``, ``3.2 MB``, ``15.6 GB``: the largest decimal unit under 1000 of it, one decimal
    (whole bytes below 1 kB); TB beyond."""
    for unit in _UNITS:
        if abs(n) < 1000 or unit == _UNITS[-1]:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")
