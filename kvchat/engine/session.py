"""A conversation on an engine: token ids (the source of truth), segments, and its KV blocks.

One turn: render only the new user turn and append its ids, prefill what the
pool lacks (chunked on segment boundaries), decode token by token until a stop
id, the token limit, the context limit or cancellation, then append the
template's closing ids. History is never re-tokenized (docs/architecture.md, "How a message travels").
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from kvchat.context_fit import fits
from kvchat.engine.block_manager import PoolFullError, SeqBlocks
from kvchat.engine.persistence import chain
from kvchat.engine.runner import Engine, last_cut, prefill_start
from kvchat.engine.sampling import Sampler
from kvchat.engine.sequence import DecodeStep, PrefillChunk, Sequence
from kvchat.engine.shared_prompt import SharedPrompt
from kvchat.engine.token_rules import TokenRules
from kvchat.engine.turn import SamplingParams, TurnStats
from kvchat.model.chat_format import ChatFormat, Segment, UserTurn, append_segment
from kvchat.utf8 import require_utf8

DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful assistant. When documents are provided, answer from them and say so when they do not cover the question."
)


class EmptyPromptError(ValueError):
    """The user message is empty or whitespace only."""


@dataclass(slots=True)
class Turn:
    """A finished turn (:attr:`Session.last_turn`, once :meth:`Session.turn`'s steps ended)."""

    text: str = ""
    user_span: tuple[int, int] = (0, 0)
    assistant_span: tuple[int, int] = (0, 0)
    stats: TurnStats = field(default_factory=TurnStats)
    user: UserTurn | None = None  # the rendered user message (its pasted document's part, if any)


class Session:
    """One conversation bound to an engine.

    Attributes:
        sequence: token ids, segments and blocks together (:class:`kvchat.engine.sequence.Sequence`);
            ``token_ids``, ``segments`` and ``blocks`` are read-only shorthands for its fields.
    """

    def __init__(self, engine: Engine, fmt: ChatFormat, token_ids: list[int], segments: list[Segment], persist=None):
        self.engine = engine
        self.persist = persist
        self.fmt = fmt
        self.sequence = Sequence(token_ids, segments, SeqBlocks())
        self.last_turn: Turn | None = None

    @property
    def token_ids(self) -> list[int]:
        """The whole conversation, ids."""
        return self.sequence.token_ids

    @property
    def segments(self) -> list[Segment]:
        """Prefix, then one user and one assistant segment per turn."""
        return self.sequence.segments

    @property
    def blocks(self) -> SeqBlocks:
        """The conversation's blocks in the engine's pool."""
        return self.sequence.blocks

    @classmethod
    def new(cls, engine: Engine, fmt: ChatFormat, system: str, documents: list[tuple[str, str]], persist=None) -> "Session":
        """A fresh conversation whose prefix segment holds ``system`` and ``documents`` ``(title, text)``.

        ``persist`` (a :class:`kvchat.engine.persistence.KVPersist`) enables restoring
        from and saving to snapshot files.

        Raises:
            kvchat.utf8.NotUtf8Error: the system prompt or a document's title or text is not UTF-8.
        """
        require_utf8(system, "the system prompt")
        for title, text in documents:
            require_utf8(title, f"the document title {title!r}")
            require_utf8(text, f"the document {title!r}")
        ids: list[int] = []
        segments: list[Segment] = []
        append_segment(ids, segments, "prefix", fmt.prefix_ids(system, documents))
        return cls(engine, fmt, ids, segments, persist)

    @property
    def boundaries(self) -> list[int]:
        """Segment start offsets and pasted documents' ends (tokens), for the prefill chunk plan."""
        return sorted({s.start for s in self.segments} | set(self.sequence.document_ends))

    def append_user(self, turn: UserTurn) -> None:
        """Append a rendered user turn (:meth:`ChatFormat.user_turn`), marking its pasted document's end."""
        if turn.document_end is not None:
            self.sequence.document_ends.append(len(self.token_ids) + turn.document_end)
        append_segment(self.token_ids, self.segments, "user", turn.ids)

    @property
    def tokens_left(self) -> int:
        """Tokens the context can still take."""
        return self.engine.max_context - len(self.token_ids)

    def attach_cached_prefix(self, stats: TurnStats, whole: bool = False) -> None:
        """Reuse cached K/V before prefill: pool prefix hits first, then snapshot files.

        ``whole``: the token list is a prefix held for later turns (an opened chat's history, a documents
        prefix), so the files may cover all of it; otherwise its last token is left to compute for logits.

        What is reused ends at an edge of the cold chunk plan (:func:`last_cut`) or covers the whole list,
        so every token computed afterwards runs in a cold run's chunks and its K/V are bit-identical to a
        cold run's. A pool hit covers whole blocks only and stops inside a chunk when a segment does not
        end on a block (the documents' prefix of another chat); the files, whose tails end at segment
        ends, then give the rest exactly when that prefix was stored. What still ends inside a chunk (no
        file, or a chain that stops early: a chunk missing or corrupt) is cut back to the chunk's start.
        """
        if not self.blocks.block_table:
            stats.from_memory = self.engine.blocks.attach_prefix(self.blocks, self.token_ids)
        held = self.blocks.num_computed  # a pool hit, or a live chat's history
        if self.persist is not None:
            recompute_from = last_cut(held, self.boundaries)
            res = self.persist.restore(self.blocks, self.token_ids, whole, recompute_from)
            have = self.blocks.num_computed
            if have < len(self.token_ids) and last_cut(have, self.boundaries) < have and self.persist.writing():
                # another chat's snapshot still on its way to disk (a question on the same document sent the
                # moment the last answer came) holds the tail that the pool's whole blocks stop short of
                self.persist.flush()
                more = self.persist.restore(self.blocks, self.token_ids, whole, recompute_from)
                res.restore_ms += more.restore_ms
                res.bytes_read += more.bytes_read
                res.miss_reason = more.miss_reason or res.miss_reason
            stats.restore_ms, stats.bytes_read, stats.miss_reason = res.restore_ms, res.bytes_read, res.miss_reason
        have = self.blocks.num_computed
        cut = have if have >= len(self.token_ids) else last_cut(have, self.boundaries)
        self.blocks.num_computed = cut
        # the counters say what is reused (reused = from_memory + from_disk); bytes_read stays the bytes
        # actually read, those of trimmed chunks included
        stats.from_memory = min(stats.from_memory, cut)
        stats.from_disk = max(cut - held, 0)
        stats.reused_tokens = cut

    def prefix_steps(self, announce: Callable[[int, int], None] | None = None):
        """Make the whole token list (e.g. a documents-only prefix) resident, as steps for the engine loop
        (:meth:`kvchat.engine.loop.EngineLoop.run`; yields :class:`PrefillChunk`): reuse (all of it, when
        stored: no logits are wanted), then prefill what is left. Returns the :class:`TurnStats`.

        ``announce(0, total)`` (tokens of this prefill) once the reuse is known, before the first chunk runs."""
        stats = TurnStats(prompt_tokens=len(self.token_ids))
        yield from self._reuse_and_prefill_steps(stats, whole=True, announce=announce)
        return stats

    def _reuse_and_prefill_steps(self, stats: TurnStats, whole: bool = False,
                                 announce: Callable[[int, int], None] | None = None):
        """Cached K/V first, then prefill the rest as steps (yields :class:`PrefillChunk`); fills the stats,
        returns the engine's PrefillResult, or None when ``whole`` (see :meth:`attach_cached_prefix`) and all
        of it was reused: no logits are wanted, nothing runs. ``announce(0, tokens to prefill)`` is called
        before the first chunk."""
        self.attach_cached_prefix(stats, whole)
        if whole and self.blocks.num_computed == len(self.token_ids):
            return None
        if announce is not None:
            n = len(self.token_ids)
            announce(0, n - prefill_start(self.blocks.num_computed, n, self.boundaries))
        result = yield from self.engine.prefill_steps(self.blocks, self.token_ids, self.boundaries, self.sequence.dense)
        stats.prefilled_tokens, stats.prefill_ms = result.prefilled_tokens, result.prefill_ms
        return result

    def save_snapshot(self, owner: str | None) -> list[str]:
        """Queue this conversation's computed K/V for writing (no-op without ``persist``); returns chain keys.

        Tails at the prefix's end and at each pasted document's end."""
        if self.persist is None:
            return []
        return self.persist.save(self.blocks, self.token_ids, [self.segments[0].end, *self.sequence.document_ends],
                                 owner)

    def share_snapshot(self, owner: str, end: int) -> list[str]:
        """Give ``owner`` (a pasted document) references on the chain of the first ``end`` tokens, one of
        :meth:`save_snapshot`'s tails (the prefix's or a pasted document's end), after that save: it reads
        and writes nothing (:meth:`kvchat.engine.persistence.KVPersist.add_refs`). Returns the keys."""
        if self.persist is None:
            return []
        ends = [e for e in (self.segments[0].end, *self.sequence.document_ends) if e < end] + [end]
        keys = [link.key for link in chain(self.persist.fingerprint, self.token_ids, ends)]
        self.persist.add_refs(owner, keys)
        return keys

    def check_turn_fits(self, text: str, user: UserTurn | None = None) -> UserTurn:
        """Render the user turn (``user``: ``text`` already rendered, not tokenized again) and check it fits,
        before any work.

        Returns:
            The rendered turn (hand it to :meth:`turn` so the message is not tokenized again).
        Raises:
            EmptyPromptError: blank message.
            kvchat.utf8.NotUtf8Error: the message is not UTF-8 (a lone surrogate).
            kvchat.context_fit.ContextFullError: the conversation plus the turn and one answer
                token exceed the context (message names both lengths).
        """
        if not text.strip():
            raise EmptyPromptError("the prompt is empty")
        require_utf8(text, "the prompt")
        turn = user or self.fmt.user_turn(text)
        needed = len(self.token_ids) + len(turn.ids) + 1
        self.engine.check_fits(needed, f"this turn needs {needed} tokens (conversation {len(self.token_ids)} + "
                                        f"message {len(turn.ids)} + 1 to answer)")
        return turn

    def turn(self, text: str, params: SamplingParams, cancel: threading.Event | None = None,
             user: UserTurn | None = None, rules: TokenRules | None = None, shared: SharedPrompt | None = None):
        """Add a user message and answer it, as steps for the engine loop: yields text pieces, :class:`PrefillChunk` after
        each prefill chunk, and
        :class:`DecodeStep` whenever it needs logits, which the caller sends back (float32 ``[vocab_size]``),
        or the id it sampled from them with the step's sampler.
        ``user``: ``text`` as :meth:`check_turn_fits` rendered it, for this token list (else rendered here).
        ``rules``: an API request's logit bias, grammar and log-probabilities (the sampler's hook).
        ``shared``: a prompt prefilled once for several sequences (an API request's choices): a sequence
        with no blocks yet forks it when it is published with these ids, else publishes its own prefill.

        After the steps end :attr:`last_turn` holds the text, spans and stats. The generated ids are kept as
        produced; a turn ended by cancellation, the token limit or the context limit gets the full closing ids.

        Raises:
            EmptyPromptError, ContextFullError: before anything changes.
            kvchat.engine.block_manager.PoolFullError: the pool cannot hold the conversation.
        """
        t0 = time.perf_counter()
        sampler = Sampler(params, rules)
        user = user or self.check_turn_fits(text)
        user_start = len(self.token_ids)
        self.append_user(user)
        stats = TurnStats(prompt_tokens=len(self.token_ids))
        forked = shared.take(self.engine.blocks, self.token_ids) if shared and not self.blocks.block_table else None
        if forked is not None:
            self.sequence.blocks, logits = forked
            stats.reused_tokens = stats.from_memory = len(self.token_ids)
        else:
            try:
                result = yield from self._reuse_and_prefill_steps(stats)
            except BaseException:  # pool full, interrupted: the conversation is as before
                self._undo_turn(user_start)
                raise
            logits = result.logits
            if shared is not None:
                shared.publish(self.token_ids, self.blocks, logits)
        gen_start = len(self.token_ids)
        generated: list[int] = []
        stop_id, shown = None, ""
        t_first = t_last = None
        while True:
            token = logits if isinstance(logits, int) else sampler(logits)  # a batch's caller may have sampled
            generated.append(token)
            t_last = time.perf_counter()
            if t_first is None:
                t_first = t_last
                stats.ttft_ms = (t_first - t0) * 1e3
            if token in self.fmt.stop_token_ids:
                stop_id, stats.finish_reason = token, "stop"
                break
            full = self.fmt.decode(generated)
            if not full.endswith("\ufffd"):
                yield full[len(shown):]
                shown = full
            if len(generated) >= params.max_tokens:
                stats.finish_reason = "length"
                break
            if not fits(len(self.token_ids) + len(generated) + len(self.fmt.assistant_close_ids(None)) + 1,
                        self.engine.max_context):  # no room for one more token and the closing ids
                stats.finish_reason = "context"
                break
            if cancel is not None and cancel.is_set():
                stats.finish_reason = "cancelled"
                break
            logits = yield DecodeStep(self.sequence, self.token_ids + generated, sampler)
        stats.new_tokens = len(generated)
        if len(generated) > 1:
            stats.decode_tokens_per_s = (len(generated) - 1) / max(t_last - t_first, 1e-9)
        text_out = self.fmt.decode([t for t in generated if t not in self.fmt.stop_token_ids])
        if text_out != shown and text_out.startswith(shown):
            yield text_out[len(shown):]
        append_segment(self.token_ids, self.segments, "assistant", generated)
        append_segment(self.token_ids, self.segments, "assistant", self.fmt.assistant_close_ids(stop_id))
        self.last_turn = Turn(text_out, (user_start, gen_start), (gen_start, len(self.token_ids)), stats, user)
        yield from self._settle_steps(gen_start)

    def _settle_steps(self, gen_start: int):
        """Recompute the answer and closing ids as prefill chunks, replacing decode's K/V; yields each
        chunk as a :class:`PrefillChunk` with ``settle=True``.

        Decode computed the answer one token at a time; a cold run, or a
        resume whose snapshot lacks this turn, computes it in chunks, and the
        two differ in the last bits (enough to flip a near-tie later). After
        this the pool holds for every token exactly what a cold run computes,
        so the snapshot and every later answer are the same either way. Runs
        after the answer was streamed, so it costs no TTFT; as steps, a
        scheduler runs other sequences' decode steps between the chunks.
        ``settle_ms`` counts this sequence's chunks only.
        """
        self.blocks.num_computed = min(self.blocks.num_computed, gen_start)
        total = len(self.token_ids) - gen_start
        yield PrefillChunk(0, total, 0, settle=True)  # before any forward: a scheduler runs the chunks in its budget
        steps = self.engine.prefill_steps(self.blocks, self.token_ids, self.boundaries, self.sequence.dense)
        own = 0.0
        while True:
            t0 = time.perf_counter()
            try:
                chunk = next(steps)
            except StopIteration:
                break
            except PoolFullError:  # the next turn's prefill recomputes from here instead
                break
            finally:
                own += time.perf_counter() - t0
            yield replace(chunk, settle=True)
        self.last_turn.stats.settle_ms = own * 1e3

    def _undo_turn(self, user_start: int) -> None:
        """Drop a turn that failed before generation: ids, segment, and the blocks holding them."""
        del self.token_ids[user_start:]
        while self.segments and self.segments[-1].start >= user_start:
            self.segments.pop()
        self.sequence.document_ends = [e for e in self.sequence.document_ends if e <= user_start]
        self.engine.release(self.blocks)

    def truncate(self, num_tokens: int) -> None:
        """Cut the conversation to its first ``num_tokens`` tokens, keeping their KV.

        Used to roll back a turn that was not stored and by regenerate/edit.
        The block manager forks the sequence at ``num_tokens`` (the kept
        blocks' ref counts go up), then the old sequence is released, so only
        the cut-off tail returns to the pool; a shared or cached block is
        copied on write when the next turn appends into it. Segments are cut
        at ``num_tokens``; :attr:`last_turn` is cleared.
        """
        child = self.engine.blocks.fork(self.blocks, num_tokens)
        self.engine.release(self.blocks)
        self.sequence.blocks = child
        del self.token_ids[num_tokens:]
        self.sequence.segments = [Segment(s.kind, s.start, min(s.end, num_tokens)) for s in self.segments
                                  if s.start < num_tokens]
        self.sequence.document_ends = [e for e in self.sequence.document_ends if e <= num_tokens]
        self.last_turn = None

    def close(self) -> None:
        """Release the conversation's blocks (they stay in the prefix cache)."""
        self.engine.release(self.blocks)

