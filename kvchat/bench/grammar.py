"""``kvchat bench grammar``: what constrained decoding (``response_format`` json_schema) costs on this machine.

In-process on the loaded model, greedy, one sequence:

- **mask cost per token**: llguidance's mask for the next token plus its -inf fill on the logits
  (:meth:`kvchat.engine.grammar.Constraint.mask`), timed for every token of a constrained answer replayed
  through a fresh matcher (µs: median, mean, p99); and the one-off costs (the tokenizer's llguidance view,
  the schema's compile).
- **decode tokens/s** of the same prompt without and with the grammar (the turn's own
  ``decode_tokens_per_s``, median of ``--repeats``).
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvchat.bench.run_info import run_info, write_json
from kvchat.bench.stats import format_table

# a nested object, an enum, a bounded array and bounded integers (tests/server/test_serve_structured.py uses it
# too); strings bounded: at temperature 0 the 135M model can repeat a phrase inside an unbounded string until
# max_tokens (the grammar keeps it valid JSON so far, but never closes the string), and maxLength makes every
# answer end within 300 tokens
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["engineer", "teacher", "doctor", "artist"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                     "zip": {"type": "integer", "minimum": 1000, "maximum": 99999}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "skills", "address"],
    "additionalProperties": False,
}
PROMPT = "Describe a violinist from Vienna as JSON."


def add_grammar_args(p: argparse.ArgumentParser) -> None:
    """The ``kvchat bench grammar`` options."""
    p.add_argument("--decode-tokens", type=int, default=128, help="tokens per answer at most")
    p.add_argument("--repeats", type=int, default=3, help="runs of each (medians reported)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")


def _answer(rt, grammars, grammar, max_tokens: int, rules_for) -> tuple[list[int], float]:
    """One greedy answer to :data:`PROMPT` in a fresh session: (its ids, its decode tokens/s)."""
    from kvchat.conversation.records import new_settings
    from kvchat.engine.loop import run_alone
    from kvchat.engine.session import Session
    from kvchat.engine.turn import SamplingParams
    from kvchat.model.chat_format import Segment

    fmt = rt.chat_format(new_settings([]))
    prefix = fmt.prefix_ids("", [])
    session = Session(rt.engine, fmt, list(prefix), [Segment("prefix", 0, len(prefix))])
    try:
        rules = rules_for(grammars, grammar)
        run_alone(rt.engine, session.turn(PROMPT, SamplingParams(temperature=0, max_tokens=max_tokens), rules=rules))
        start, stats = session.last_turn.assistant_span[0], session.last_turn.stats
        return session.token_ids[start:start + stats.new_tokens], stats.decode_tokens_per_s
    finally:
        session.close()


def _with_grammar(grammars, grammar):
    from kvchat.engine.token_rules import TokenRules

    return TokenRules(constraint=grammars.constraint(grammar))


def _mask_times_us(grammars, grammar, ids: list[int], vocab: int) -> list[float]:
    """The time of each step's mask over ``ids`` (a grammar-valid answer), µs."""
    import torch

    constraint, logits, out = grammars.constraint(grammar), torch.zeros(vocab), []
    for token_id in ids:
        t0 = time.perf_counter()
        constraint.mask(logits)
        out.append((time.perf_counter() - t0) * 1e6)
        constraint.advance(token_id)
    return out


def cmd_bench_grammar(args: argparse.Namespace) -> int:
    """Run the benchmark; print a table (and write ``--json``)."""
    import torch

    from kvchat.conversation.records import new_settings
    from kvchat.engine.grammar import GrammarCompiler, json_schema_grammar
    from kvchat.engine.inference import inference
    from kvchat.runtime import load_runtime

    rt = load_runtime(args.model, args.kv_dtype)
    vocab = rt.engine.cfg.vocab_size
    grammars = GrammarCompiler(rt.tokenizer, rt.chat_format(new_settings([])).stop_token_ids, vocab)
    t0 = time.perf_counter()
    grammars.tokenizer
    t1 = time.perf_counter()
    grammar = json_schema_grammar(SCHEMA)
    grammars.constraint(grammar)
    t2 = time.perf_counter()
    with inference():
        plain = [_answer(rt, grammars, grammar, args.decode_tokens, lambda g, _: None)[1] for _ in range(args.repeats)]
        runs = [_answer(rt, grammars, grammar, args.decode_tokens, _with_grammar) for _ in range(args.repeats)]
    ids = [t for t in runs[0][0] if t not in grammars.stop_ids]
    masks = sorted(_mask_times_us(grammars, grammar, ids, vocab))
    result = {
        "run": run_info(threads=torch.get_num_threads()), "model": rt.info.name, "answer_tokens": len(ids),
        "answer": rt.tokenizer.decode(ids),
        "tokenizer_view_ms": (t1 - t0) * 1e3, "schema_compile_ms": (t2 - t1) * 1e3,
        "mask_us_median": statistics.median(masks), "mask_us_mean": statistics.fmean(masks),
        "mask_us_p99": masks[min(len(masks) - 1, int(0.99 * len(masks)))],
        "decode_tok_s_plain": statistics.median(plain), "decode_tok_s_grammar": statistics.median(r[1] for r in runs),
    }
    print(format_table([["figure", "value"],
        ["answer tokens (grammar)", str(len(ids))],
        ["mask per token, median / mean / p99 (µs)",
         f"{result['mask_us_median']:.0f} / {result['mask_us_mean']:.0f} / {result['mask_us_p99']:.0f}"],
        ["tokenizer's llguidance view (ms, once)", f"{result['tokenizer_view_ms']:.0f}"],
        ["schema compile + matcher (ms, per request)", f"{result['schema_compile_ms']:.1f}"],
        ["decode tok/s without grammar", f"{result['decode_tok_s_plain']:.1f}"],
        ["decode tok/s with grammar", f"{result['decode_tok_s_grammar']:.1f}"],
    ]))
    print(f"answer: {result['answer']}")
    if args.json:
        write_json(args.json, result)
    return 0
