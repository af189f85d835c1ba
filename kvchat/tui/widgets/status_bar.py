"""The status bar: model, device, KV dtype, pool use, context meter, last TTFT and tokens/s, resume line."""

from __future__ import annotations

from textual.content import Content
from textual.widgets import Static

from kvchat.conversation.views import Status
from kvchat.tui.text import literal
from kvchat.units import size_text

METER_CELLS = 8
WARN_FRACTION = 0.9


def context_meter(used: int, limit: int) -> str:
    """``▰▰▱▱▱▱▱▱ 1,234/4,096`` (tokens)."""
    filled = min(METER_CELLS, round(METER_CELLS * used / limit)) if limit else 0
    return "▰" * filled + "▱" * (METER_CELLS - filled) + f" {used:,}/{limit:,}"


def status_text(st: Status, resume: bool = True) -> str:
    """Two lines: the counters, then the resume line (when ``resume``) or the current message."""
    if st.phase != "ready":
        return f"{st.phase}: {st.message}"
    pool = f"pool {st.pool_blocks_used}/{st.pool_blocks_total} blk"
    pool += f" {size_text(st.pool_bytes)}" if st.pool_bytes else ""
    first = [st.model, st.device]  # a server that is not kvchat serve gives no KV dtype or pool figures
    first += [f"KV {st.kv_dtype}"] if st.kv_dtype else []
    first += [pool] if st.pool_blocks_total else []
    first.append("ctx " + context_meter(st.context_used, st.context_limit))
    if st.last_ttft_ms is not None:
        first.append(f"TTFT {st.last_ttft_ms:,.0f} ms")
    if st.last_tokens_per_s:
        first.append(f"{st.last_tokens_per_s:.1f} tok/s")
    second = st.resume.line if resume and st.resume else st.message
    return " · ".join(first) + "\n" + second


class StatusBar(Static):
    """Shows a :class:`kvchat.tui.backend.Status`; CSS class ``-warn`` when the context is ≥ 90 % full."""

    def show(self, st: Status, note: str = "", resume: bool = True) -> None:
        """Render ``st``; ``note`` (e.g. ``generating…``) replaces the second line when given.

        ``resume``: show ``st.resume`` (how the open chat's KV got into the pool); the chat screen turns it
        off once a turn finishes, when the first line's TTFT and tokens/s describe that turn instead.
        """
        text = status_text(st, resume)
        if note:
            text = text.split("\n")[0] + "\n" + note
        self.update(Content(literal(text)))
        self.set_class(bool(st.context_limit) and st.context_used >= WARN_FRACTION * st.context_limit, "-warn")
