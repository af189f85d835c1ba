"""Long-context retrieval probe: does the fp8 pool lose a fact that the bf16 pool keeps?

A made-up fact (:data:`FACT`) is planted as its own paragraph at several
depths (share of the document's tokens before it) of a long real document
(filler: the fidelity texts, by default standard-library docstrings). The
chat is: kvchat's system prompt and the document (prefix segment), a user
turn asking :data:`QUESTION`, and the assistant answer
``"<ANSWER_LEAD> <VALUE>"`` teacher-forced. The metric is the
log-probability of the value's tokens (the part only the document can
tell), summed over them, in nats; a 135M model rarely answers such questions
exactly, so exact match would measure nothing. The same document without the
fact is the control: log p(value | no fact) is what guessing gets, so
``with fact − control`` is what retrieval adds.

Both pools run the engine's own path (:meth:`Engine.prefill_steps` up to the
answer, then :meth:`Engine.score` over the answer; every chunk attends
through its pool), on the same ids, so the only difference is the KV dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvchat.engine.inference import inference
from kvchat.texts import BenchText

FACT_KEY = "the access code for the archive room"
FACT_VALUE = "7391-KESTREL"
FACT = f"Note for the reader: {FACT_KEY} is {FACT_VALUE}. Remember it."
QUESTION = "What is the access code for the archive room?"
ANSWER_LEAD = "The access code for the archive room is"
DEFAULT_DEPTHS = (0.1, 0.5, 0.9)
DEFAULT_DOC_TOKENS = 4096
DOC_TITLE = "reference.txt"


class RetrievalSetupError(ValueError):
    """The probe cannot be built (filler too short, a tokenizer that merges the answer's boundary)."""


@dataclass(slots=True, frozen=True)
class Probe:
    """One chat to score: ids, where the value's tokens are, and where the fact sits (tokens)."""

    depth: float | None  # requested depth; None = control (no fact)
    ids: list[int]
    boundaries: list[int]  # segment starts (prefix, user turn, answer)
    value_start: int  # index in ids of the first value token
    fact_token: int | None  # tokens of the document text before the fact
    doc_tokens: int


def _paragraphs(filler: str) -> list[str]:
    return [p.strip() for p in filler.split("\n\n") if p.strip()]


def filler_document(tokenizer, filler: str, doc_tokens: int) -> list[str]:
    """Paragraphs of ``filler`` that, joined by blank lines, hold ``doc_tokens`` tokens (±2; the last one is cut).

    Raises:
        RetrievalSetupError: the filler has fewer than ``doc_tokens`` tokens.
    """
    count = lambda parts: len(tokenizer.encode("\n\n".join(parts), add_special_tokens=False))  # noqa: E731
    out: list[str] = []
    for p in _paragraphs(filler):
        if count([*out, p]) < doc_tokens:
            out.append(p)
            continue
        room = doc_tokens - (count([*out, ""]) if out else 0)
        cut = tokenizer.decode(tokenizer.encode(p, add_special_tokens=False)[:room]).strip()
        return [*out, cut] if cut else out
    raise RetrievalSetupError(f"the filler text has {count(out)} tokens; {doc_tokens} needed")


def plant(paragraphs: Sequence[str], depth: float, tokenizer) -> tuple[str, int]:
    """The document with :data:`FACT` inserted before the paragraph at ``depth`` (0–1 of its tokens).

    Returns:
        ``(document text, tokens of the document before the fact)``.
    """
    counts = [len(tokenizer.encode(p, add_special_tokens=False)) for p in paragraphs]
    total, before, i = sum(counts), 0, 0
    while i < len(paragraphs) and before + counts[i] / 2 < depth * total:
        before += counts[i]
        i += 1
    head = "\n\n".join(paragraphs[:i])
    text = "\n\n".join([*paragraphs[:i], FACT, *paragraphs[i:]])
    return text, len(tokenizer.encode(head, add_special_tokens=False)) if head else 0


def build_probe(fmt, tokenizer, paragraphs: Sequence[str], depth: float | None, system: str) -> Probe:
    """The chat for one depth (``None``: the control document without the fact).

    Raises:
        RetrievalSetupError: the tokenizer merges the answer lead with the value.
    """
    if depth is None:
        doc, fact_token = "\n\n".join(paragraphs), None
    else:
        doc, fact_token = plant(paragraphs, depth, tokenizer)
    prefix = fmt.prefix_ids(system, [(DOC_TITLE, doc)])
    user = fmt.user_turn_ids(QUESTION)
    lead = tokenizer.encode(ANSWER_LEAD, add_special_tokens=False)
    answer = tokenizer.encode(f"{ANSWER_LEAD} {FACT_VALUE}", add_special_tokens=False)
    if answer[: len(lead)] != lead or len(answer) == len(lead):
        raise RetrievalSetupError("the tokenizer merges the answer lead with the value; the value's tokens are not separable")
    ids = prefix + user + answer
    doc_tokens = len(tokenizer.encode(doc, add_special_tokens=False))
    return Probe(depth, ids, [0, len(prefix), len(prefix) + len(user)], len(prefix) + len(user) + len(lead),
                 fact_token, doc_tokens)


@inference()
def score_value(engine, probe: Probe) -> dict:
    """Teacher-forced log-probabilities of the value's tokens under ``engine``'s pool.

    Returns:
        ``{logprob_sum, logprob_mean (nats), value_tokens, argmax_hits}``
        (``argmax_hits``: value tokens that are the engine's top-1 prediction).
    """
    from kvchat.engine.block_manager import SeqBlocks
    from kvchat.engine.loop import run_alone

    seq = SeqBlocks()
    cut = probe.value_start - 1  # the position predicting the first value token is scored, not prefilled
    try:
        run_alone(engine, engine.prefill_steps(seq, probe.ids[:cut], probe.boundaries))
        logits = engine.score(seq, probe.ids, probe.boundaries)  # rows for positions cut .. len-1
    finally:
        engine.release(seq)
    targets = torch.tensor(probe.ids[probe.value_start:])
    logp = torch.log_softmax(logits[: len(targets)].float(), dim=-1)
    picked = logp.gather(-1, targets[:, None])[:, 0]
    return {"logprob_sum": picked.sum().item(), "logprob_mean": picked.mean().item(), "value_tokens": len(targets),
            "argmax_hits": int((logp.argmax(-1) == targets).sum())}


def run_retrieval(info, tokenizer, filler: BenchText, doc_tokens: int = DEFAULT_DOC_TOKENS,
                  depths: Sequence[float] = DEFAULT_DEPTHS, pools: Sequence[str] = ("bf16", "fp8")) -> dict:
    """The probe at every depth (plus the control) for each pool dtype; JSON-ready.

    Args:
        info: :class:`kvchat.model.registry.ModelInfo` of the model.
        tokenizer: its tokenizer.
        filler: the long real text the fact is hidden in.
        doc_tokens: document length in tokens (without the fact).
        depths: fact positions, shares of the document (0–1).
        pools: KV dtypes to compare; the first is the reference.
    Raises:
        RetrievalSetupError: see :func:`filler_document`, :func:`build_probe`; ValueError: a depth outside 0–1.
    """
    from kvchat.engine.kv_pool import KVCacheSpec
    from kvchat.engine.runner import Engine
    from kvchat.engine.session import DEFAULT_SYSTEM_PROMPT
    from kvchat.model.registry import load_weights
    from kvchat.runtime import Runtime, ensure_calibration

    if any(not 0 <= d <= 1 for d in depths):
        raise ValueError(f"--depths must lie in 0..1, got {list(depths)}")
    cfg = info.config
    fmt = Runtime(info, None, tokenizer).chat_format({"date_string": "01 Jan 2025"})
    paragraphs = filler_document(tokenizer, filler.text, doc_tokens)
    probes = [build_probe(fmt, tokenizer, paragraphs, d, DEFAULT_SYSTEM_PROMPT) for d in (None, *depths)]
    longest = max(len(p.ids) for p in probes)
    weights = load_weights(info)
    calibration = ensure_calibration(info, weights, tokenizer) if "fp8" in pools else None
    scores: dict[str, list[dict]] = {}
    for kv in pools:
        spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv)
        engine = Engine(cfg, weights, info.fingerprint, kv_dtype=kv, name=info.name, calibration=calibration,
                        pool_bytes=spec.bytes_per_block * (longest // spec.block_size + 3))
        engine.check_fits(longest)
        scores[kv] = [score_value(engine, p) for p in probes]
        del engine
    del weights
    ref = pools[0]
    rows = []
    for i, p in enumerate(probes):
        row = {"depth": p.depth, "fact_at_token": p.fact_token, "doc_tokens": p.doc_tokens, "chat_tokens": len(p.ids),
               "actual_depth": None if p.fact_token is None else round(p.fact_token / p.doc_tokens, 3)}
        for kv in pools:
            s = scores[kv][i]
            row[kv] = {k: round(v, 4) if isinstance(v, float) else v for k, v in s.items()}
            row[kv]["gain_vs_control"] = round(s["logprob_sum"] - scores[kv][0]["logprob_sum"], 4)
            row[kv]["value_prob"] = math.exp(s["logprob_mean"])  # geometric-mean probability per value token
        for kv in pools[1:]:
            row[f"{kv}_minus_{ref}"] = round(scores[kv][i]["logprob_sum"] - scores[ref][i]["logprob_sum"], 4)
        rows.append(row)
    return {"fact": FACT, "question": QUESTION, "answer_lead": ANSWER_LEAD, "value": FACT_VALUE,
            "filler": {"name": filler.name, "sha256": filler.sha256}, "doc_tokens_requested": doc_tokens,
            "pools": list(pools), "reference_pool": ref, "rows": rows}


def format_retrieval(res: dict) -> str:
    """Human-readable table of a :func:`run_retrieval` result."""
    ref, others = res["reference_pool"], res["pools"][1:]
    head = (f"long-context retrieval: fact {res['value']!r} planted in {res['doc_tokens_requested']} tokens of "
            f"{res['filler']['name']}; log p(value tokens | chat), nats, teacher-forced; control = no fact")
    cols = ["depth", "fact at token"] + [f"{kv} log p" for kv in res["pools"]]
    cols += [f"{kv} - {ref}" for kv in others] + [f"{kv} gain vs control" for kv in res["pools"]] + ["argmax hits"]
    rows = [tuple(cols)]
    for r in res["rows"]:
        rows.append((
            "control" if r["depth"] is None else f"{r['depth']:.0%} ({r['actual_depth']:.0%})",
            "-" if r["fact_at_token"] is None else str(r["fact_at_token"]),
            *(f"{r[kv]['logprob_sum']:.3f}" for kv in res["pools"]),
            *(f"{r[f'{kv}_minus_{ref}']:+.3f}" for kv in others),
            *(f"{r[kv]['gain_vs_control']:+.3f}" for kv in res["pools"]),
            " / ".join(f"{kv} {r[kv]['argmax_hits']}/{r[kv]['value_tokens']}" for kv in res["pools"]),
        ))
    from kvchat.bench.stats import format_table

    return f"{head}\n\n{format_table(rows)}"
