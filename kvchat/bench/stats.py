"""Repeated-measurement summaries for benchmarks: median with the min-max spread."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class Spread:
    """Median and range of repeated measurements (same unit as the samples)."""

    median: float
    min: float
    max: float
    samples: tuple[float, ...]

    @classmethod
    def of(cls, samples: Sequence[float]) -> Spread:
        """Summarise ``samples``. Raises ValueError if empty."""
        if not samples:
            raise ValueError("no samples to summarise")
        return cls(statistics.median(samples), min(samples), max(samples), tuple(samples))

    def fmt(self, digits: int = 1) -> str:
        """``"median (min-max)"``, e.g. ``"231.4 (220.1-240.9)"``."""
        return f"{self.median:.{digits}f} ({self.min:.{digits}f}-{self.max:.{digits}f})"

    def as_dict(self, digits: int = 3) -> dict:
        """JSON-ready ``{median, min, max, samples}`` rounded to ``digits``."""
        def r(x):
            return round(x, digits)

        return {"median": r(self.median), "min": r(self.min), "max": r(self.max), "samples": [r(s) for s in self.samples]}


def ratios(num: Sequence[float], den: Sequence[float]) -> Spread:
    """Spread of per-repeat ratios ``num[i] / den[i]`` (pairs measured back to back, so
    machine noise common to a pair cancels). Raises ValueError on length mismatch."""
    if len(num) != len(den):
        raise ValueError(f"ratio of {len(num)} samples over {len(den)}")
    return Spread.of([a / b for a, b in zip(num, den)])


def format_table(rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned plain-text table; the first row is the header."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
