"""Constrained decoding: a token mask per step from a grammar (JSON Schema or Lark), by llguidance.

llguidance (https://github.com/guidance-ai/llguidance) was chosen over
xgrammar: on this project's CPU it computes a JSON-schema mask in less than
half the time per token, and it refuses a JSON Schema keyword it cannot
enforce (``not``, ``if``/``then``, ``uniqueItems``) with an error naming it,
where xgrammar accepts and silently ignores some of them (docs/server.md has
the figures).

:func:`check_grammar` validates a grammar without a tokenizer (the HTTP side,
before anything is queued); :class:`GrammarCompiler` holds the tokenizer's
llguidance view (built once, ~0.5 s, off the engine loop's thread) and makes one :class:`Constraint` per
sequence; the sampler applies it (:class:`kvchat.engine.sampling.Sampler`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

# JSON output without optional whitespace: the compact separators OpenAI's own
# structured outputs use, and no run of blanks a small model can loop in
JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A grammar or JSON schema that cannot be compiled; the message names the keyword or rule at fault."""


@dataclass(frozen=True, slots=True)
class Grammar:
    """A grammar in llguidance's serialized form (``LLMatcher.grammar_from_*``), already validated.

    Attributes:
        text: the serialized grammar.
        source: what it came from, for messages (``json_schema``, ``json_object``, ``tool call``).
    """

    text: str
    source: str


def json_schema_grammar(schema: dict, source: str = "json_schema") -> Grammar:
    """A validated grammar for JSON documents that satisfy ``schema`` (a JSON Schema object).

    Raises:
        GrammarError: the schema is not an object, uses a keyword llguidance cannot enforce, or is invalid
            (llguidance's message, which names the keyword).
    """
    import llguidance

    if not isinstance(schema, dict):
        raise GrammarError(f"{source}: the schema must be a JSON object")
    try:
        text = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"{source}: {exc}") from None
    return check_grammar(Grammar(text, source))


def lark_grammar(lark: str, source: str) -> Grammar:
    """A validated grammar from Lark text (llguidance's dialect, which may embed ``%json {…}`` schemas).

    Raises:
        GrammarError: the grammar does not compile.
    """
    import llguidance

    return check_grammar(Grammar(llguidance.LLMatcher.grammar_from_lark(lark), source))


def check_grammar(grammar: Grammar) -> Grammar:
    """``grammar`` if llguidance compiles it (no tokenizer needed).

    Raises:
        GrammarError: with llguidance's first error line (e.g. ``Unimplemented keys: ["not"]``).
    """
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(grammar.text)
    if error:
        raise GrammarError(f"{grammar.source}: {_first_line(error)}")
    return grammar


def _first_line(message: str) -> str:
    return next((line.strip() for line in message.splitlines() if line.strip()), message)


class GrammarCompiler:
    """The tokenizer's llguidance view (~0.5 s to build for a 49K vocabulary) and the matchers made from it.

    A server builds the view at start on a thread of its own (:meth:`start`) and waits for it
    (:meth:`wait`) on a request's own thread before queueing a request that needs it, so the engine loop,
    which makes the matchers, never stalls every running stream for it.

    Args:
        tokenizer: the model's transformers tokenizer.
        stop_ids: the chat format's end-of-answer ids: the mask allows them exactly where the grammar is
            complete.
        vocab_size: the model's logits width (may exceed the tokenizer's: padding rows are never allowed).
    """

    def __init__(self, tokenizer, stop_ids: set[int], vocab_size: int):
        self._hf, self.stop_ids, self.vocab_size = tokenizer, sorted(stop_ids), vocab_size
        self._tokenizer = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Build the view on a new daemon thread (returns at once; a failure there is raised again by the
        next :meth:`wait`, which then builds it itself)."""
        threading.Thread(target=self._build_quietly, name="kvchat-grammar-tokenizer", daemon=True).start()

    @property
    def ready(self) -> bool:
        """The view is built: :attr:`tokenizer` returns at once."""
        return self._tokenizer is not None

    def wait(self) -> None:
        """Return once the view is built (building it on this thread if no other is)."""
        self.tokenizer  # noqa: B018 - the property builds it

    @property
    def tokenizer(self):
        """The ``llguidance.LLTokenizer`` (built once; a caller meanwhile waits for the thread building it)."""
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size,
                                                               eos_token=self.stop_ids)
        return self._tokenizer

    def _build_quietly(self) -> None:
        try:
            self.wait()
        except Exception:  # noqa: BLE001, S110 - wait() on the request's thread builds again and raises it there
            pass

    def constraint(self, grammar: Grammar) -> "Constraint":
        """A fresh matcher for one sequence.

        Raises:
            GrammarError: the grammar does not compile against this tokenizer.
        """
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer, grammar.text, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{grammar.source}: {_first_line(matcher.get_error())}")
        return Constraint(matcher, self.vocab_size, grammar.source)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` stands for (a piece of a UTF-8 character for some byte tokens)."""
        return self.tokenizer.decode_bytes([token_id])


class Constraint:
    """One sequence's grammar state: which ids may come next, advanced by each id picked.

    ``mask`` costs one llguidance mask computation on the host, the bitmask's unpacking and one masked fill
    on the logits' device: 0.2-0.3 ms a token for a JSON schema over a 49K vocabulary
    (docs/performance.md, "Structured output").
    """

    def __init__(self, matcher, vocab_size: int, source: str):
        # llguidance.torch is not imported: it torch.compile-decorates a kernel at import (seconds of
        # torch._dynamo start-up in the first request); the matcher writes the bits through a pointer instead
        self._matcher, self.vocab_size, self.source = matcher, vocab_size, source
        self._bitmask = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)  # bit j of word w: id 32w + j
        self._shifts = torch.arange(32, dtype=torch.int32)

    def allowed(self) -> torch.Tensor:
        """bool ``[vocab_size]`` on the CPU: the ids the grammar accepts next.

        Raises:
            GrammarError: the matcher is in an error state (an id it refused was forced on it).
        """
        self._matcher.unsafe_compute_mask_ptr(self._bitmask.data_ptr(), self._bitmask.numel() * 4)
        if self._matcher.is_error():
            raise GrammarError(f"{self.source}: {_first_line(self._matcher.get_error())}")
        bits = (self._bitmask.unsqueeze(1) >> self._shifts) & 1  # [words, 32]
        return bits.view(-1)[: self.vocab_size].bool()

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` ``[vocab_size]`` with every id the grammar refuses next set to -inf (a new tensor)."""
        allowed = self.allowed().to(logits.device, non_blocking=True)
        return logits.masked_fill(~allowed, float("-inf"))

    def advance(self, token_id: int) -> None:
        """Consume the id picked (a stop id once the grammar is complete ends it).

        Raises:
            GrammarError: the grammar refuses the id (only possible when the caller ignored the mask).
        """
        if not self._matcher.consume_token(token_id):
            raise GrammarError(f"{self.source}: {_first_line(self._matcher.get_error())}")
