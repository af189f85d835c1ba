"""What the conversation service hands its front-ends: plain, torch-free dataclasses and one error.

Cache fields (:attr:`ChatSummary.cache_state`, :class:`ResumeInfo`) report
what the engine's counters and the store say: ``"memory"`` when the pool
holds the whole history, ``"disk"`` when snapshots under this engine's cache
fingerprint exist, ``"none"`` otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from kvchat.context_fit import ContextFullError as ContextFullError  # the front ends catch it from here

if TYPE_CHECKING:
    from kvchat.engine.disk_budget import Eviction

CacheState = Literal["memory", "disk", "none"]
SYSTEM_PROMPT_FIXED = "the system prompt starts the chat's cached prefix; it can be set only before the first message"


class AttachCancelled(Exception):
    """A document attach was cancelled (Esc, quit) before its chat opened; nothing of it was stored."""


@dataclass(slots=True)
class ResumeInfo:
    """How a chat's history got into the KV pool when it was opened (engine counters).

    ``tokens`` were reused in ``ms``: ``from_disk`` of them read from snapshot
    files, the rest found in the pool's prefix cache; ``prefill`` history
    tokens were not cached and will be prefilled (0 when less than a block
    short); ``miss_reason`` says why stored
    KV could not be used, if some was skipped.
    """

    tokens: int
    from_disk: int
    ms: float
    miss_reason: str | None = None
    prefill: int = 0

    @property
    def source(self) -> CacheState:
        """Where most of it came from: ``disk`` if any was read from files."""
        return "disk" if self.from_disk else "memory" if self.tokens else "none"

    @property
    def line(self) -> str:
        """E.g. ``resumed 3,812 tokens from disk in 41 ms — prefill skipped``."""
        if not self.tokens:
            return f"no cached KV ({self.miss_reason or 'none stored'}): the history will be prefilled"
        memory = self.tokens - self.from_disk
        where = ("from disk" if not memory else "from memory" if not self.from_disk
                 else f"({memory:,} from memory, {self.from_disk:,} from disk)")
        line = f"resumed {self.tokens:,} tokens {where} in {self.ms:.0f} ms"
        if self.prefill:
            line += f"; {self.prefill:,} more will be prefilled"
            return line + (f" ({self.miss_reason})" if self.miss_reason else "")
        line += " — prefill skipped"
        return line + (f" (partly: {self.miss_reason})" if self.miss_reason else "")


@dataclass(slots=True)
class Status:
    """What the status bar shows. Sizes in blocks and bytes; context in tokens; times in ms."""

    phase: Literal["loading", "ready", "error"] = "loading"
    message: str = ""
    model: str = ""
    device: str = ""
    kv_dtype: str = ""
    pool_blocks_used: int = 0
    pool_blocks_total: int = 0
    pool_bytes: int = 0
    context_used: int = 0
    context_limit: int = 0
    last_ttft_ms: float | None = None
    last_tokens_per_s: float | None = None
    resume: ResumeInfo | None = None


@dataclass(slots=True)
class ChatSummary:
    """A sidebar row: a stored chat, its size and where its KV lives (``cached_tokens``: tokens in the pool)."""

    id: str
    title: str
    updated: float
    num_tokens: int
    num_messages: int
    pinned: bool
    cache_state: CacheState
    cached_tokens: int


@dataclass(slots=True)
class DocumentSummary:
    """A document attached in some chat: its title, token count and where its prefix's KV lives.

    ``tokens``: its prefix (system prompt + the document); ``cache_state``: ``memory`` (in the pool),
    ``disk`` (a snapshot this engine can restore), ``none``; ``cached_tokens``: of the prefix, those a
    resume reuses (all in the pool, else those restorable from disk; 0 after ``kvchat cache purge``).
    """

    id: str
    title: str
    path: str
    tokens: int
    cache_state: CacheState
    cached_tokens: int = 0

    @property
    def cached(self) -> bool:
        """True when the document's prefix need not be prefilled again (in memory or on disk)."""
        return self.cache_state != "none"


@dataclass(slots=True)
class ChatMessage:
    """One displayed message; ``ttft_ms``/``tokens_per_s``/``finish_reason`` (how it ended:
    :attr:`kvchat.engine.turn.TurnStats.finish_reason`, "" if not known) for answers when known."""

    role: Literal["user", "assistant"]
    text: str
    ttft_ms: float | None = None
    tokens_per_s: float | None = None
    finish_reason: str = ""


def answer_figures(messages: Sequence[ChatMessage]) -> tuple[float | None, float | None]:
    """``(ttft_ms, tokens_per_s)`` of the last answer in ``messages`` (a chat's own last-turn figures for the
    status bar); ``(None, None)`` when it has no answer or its answer has none."""
    for message in reversed(messages):
        if message.role == "assistant":
            return message.ttft_ms, message.tokens_per_s
    return None, None


@dataclass(slots=True)
class ChatView:
    """The open chat. ``id`` is None for a new chat until its first turn is stored."""

    id: str | None
    title: str
    system_prompt: str
    documents: list[str]
    messages: list[ChatMessage]
    num_tokens: int
    context_limit: int
    resume: ResumeInfo | None = None


@dataclass(slots=True)
class CacheRow:
    """One chat on the cache screen: KV bytes on disk and in the pool, pin, and why it would miss (if known).

    ``cached_tokens``: the history tokens a resume reuses, from the pool or from disk, whichever covers
    more (from the pool never the last token: a pool hit never covers it).
    """

    chat_id: str
    title: str
    num_tokens: int
    cache_state: CacheState
    cached_tokens: int
    memory_bytes: int
    disk_bytes: int
    pinned: bool
    miss_reason: str = ""


@dataclass(slots=True)
class CacheReport:
    """The cache screen: per-chat rows and totals vs budgets (bytes)."""

    rows: list[CacheRow] = field(default_factory=list)
    disk_bytes: int = 0
    disk_budget_bytes: int | None = None
    pool_bytes: int = 0
    pool_blocks_used: int = 0
    pool_blocks_total: int = 0


@dataclass(slots=True)
class OwnerRow:
    """A row of ``kvchat cache ls``: one chat or document and the snapshot chunks it references.

    ``tokens``: what a resume restores from disk, of a chat's history or of a document's prefix (the CACHED
    column of ``kvchat cache ls`` and ``kvchat doc list``); ``bytes``: the chunks' size on disk.
    """

    owner: str
    title: str
    tokens: int
    chunks: int
    bytes: int
    pinned: bool


@dataclass(slots=True)
class StoreTotals:
    """All snapshot chunks (bytes) against the disk budget (:func:`kvchat.engine.disk_budget.budget_bytes`)."""

    chunks: int
    bytes: int
    pinned_chunks: int
    pinned_bytes: int
    budget_bytes: int


@dataclass(slots=True)
class GcResult:
    """What ``kvchat cache gc`` removed: stray files (and their bytes), rows without a file, and the budget pass."""

    files_removed: int
    bytes_freed: int
    rows_removed: int
    evicted: Eviction


@dataclass(slots=True)
class ChainLink:
    """One snapshot chunk of a chat's chain: tokens ``[start, end)``; ``tail``: a partial chunk at the chain's end."""

    start: int
    end: int
    tail: bool
    key: str
    bytes: int


@dataclass(slots=True)
class ChainReport:
    """``kvchat cache explain``: the chat's chain on disk under ``fingerprint`` and where it stops.

    ``stops_at``: the first token no chunk covers while more could be stored (None: the chain is whole);
    ``other_fingerprints``: chunks of other models, KV dtypes or scale schemes, never used by this one;
    ``reason``: why the chain stops where it does, as ``kvchat ask``'s ``miss_reason`` says it (None: whole).
    """

    chat_id: str
    tokens: int
    fingerprint: str
    kv_dtype: str
    links: list[ChainLink]
    restorable_tokens: int
    stops_at: int | None
    other_fingerprints: int
    reason: str | None = None


@dataclass(slots=True)
class RemovedDocument:
    """A document ``kvchat doc rm`` deleted and the chunk files that went with it (those no one else uses)."""

    id: str
    chunks_deleted: int
