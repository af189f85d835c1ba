"""``kvchat bench resume``: reopening an N-token chat from its disk snapshot vs prefilling it cold.

For each N (default 256, 512, 2048, 4096, 8000 tokens) on the default model:

1. A *build* process (fresh) makes a multi-turn conversation of exactly N
   tokens from real text (docstrings of standard-library modules, see
   :mod:`kvchat.texts`: the prefix holds the system prompt and a
   document of about 40% of N, then user turns quote a sentence and
   assistant turns hold following paragraphs), prefills it cold through the
   session (``cold prefill``), writes its snapshot and measures, with the chat
   still in the pool, the TTFT of the question (``in-memory TTFT``: what a
   never-restarted process pays). Further cold repeats (``--cold-repeats``)
   prefill again in fresh processes without writing.
2. *Resume* processes (fresh, so ``from_memory == 0``, asserted) open the
   same token list with the snapshot store attached and ask a one-line
   question; per repeat one with the snapshot files' pages dropped from the
   page cache (``fsync`` + ``posix_fadvise(DONTNEED)``, residency checked with
   ``mincore``, which reads nothing) and one with them hot. Reported: ``restore_ms``
   (lookup + read + checksum + copy into the pool), TTFT (request to first
   token: restore + prefill of the question + sampling), bytes read.
3. The disk-read floor: snapshot bytes ÷ sequential read bandwidth of the
   same disk, measured in this run on a 256 MiB file (cache dropped), and
   ÷ page-cache read bandwidth (same file, hot) for the warm case.

Figures are median (min-max) over repeats. Targets (2-core CPU,
4096 tokens): restore ≤ 100 ms warm; TTFT ≤ 300 ms and ≥ 50× faster than the
cold prefill; snapshot ≤ 0.55× an f16 cache's bytes. llama.cpp figures are
external references measured earlier on the development machine, not here.

Usage (wired by the CLI)::

    kvchat bench resume [--tokens N]... [--repeats 3] [--cold-repeats 1] [--json FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from kvchat.bench import PYTHON
from kvchat.bench.page_cache import drop_file_cache, kept_pages_warning, read_file, resident_fraction, write_random_file
from kvchat.bench.stats import Spread, format_table, ratios

DEFAULT_TOKENS = (256, 512, 2048, 4096, 8000)
QUESTION = "What is this conversation about?"
DOC_FRACTION = 0.4
LAST_TURN_MIN_TOKENS = 128
USER_QUOTE_CHARS = 200
BANDWIDTH_FILE_BYTES = 256 << 20
TARGETS = {"tokens": 4096, "restore_warm_ms": 100.0, "ttft_ms": 300.0, "ttft_speedup": 50.0, "bytes_vs_f16": 0.55,
           # restore with the page cache dropped <= factor x disk floor + slack, for chats of >= 4096 tokens
           "dropped_floor_factor": 1.5, "dropped_slack_ms": 15.0}
LLAMA_CPP_REFERENCE = {
    "tokens": 4096,
    "state_bytes": 94e6,
    "resume_plus_question_ms": 94.0,
    "question_tokens": 12,
    "cold_prefill_ms": 14000.0,
    "note": "external reference figures for llama.cpp (f16 KV state file) on SmolLM2-135M, measured earlier "
            "on the 2-core development machine; not measured in this run",
}
OWNER = None  # the bench snapshot belongs to no chat: no refs, nothing for a chat delete to release


class BenchResumeError(RuntimeError):
    """A benchmark child failed or measured something other than what the benchmark claims."""


def add_resume_args(p: argparse.ArgumentParser) -> None:
    """The ``kvchat bench resume`` options (the CLI adds ``--model``/``--kv-dtype``/``--threads`` itself)."""
    p.add_argument("--tokens", type=int, action="append", metavar="N",
                   help="conversation length in tokens (repeatable; default 256 512 2048 4096 8000)")
    p.add_argument("--repeats", type=int, default=3, help="fresh resume processes per mode and length (default 3)")
    p.add_argument("--cold-repeats", type=int, default=1,
                   help="fresh cold-prefill processes per length (default 1: minutes each on a CPU)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")


# ---- conversation ------------------------------------------------------------------------------

def build_conversation(rt, n_tokens: int, text: str) -> tuple[list[int], list, dict]:
    """A multi-turn chat of exactly ``n_tokens`` tokens made of ``text``'s paragraphs.

    The prefix is kvchat's default system prompt plus a document of about
    ``DOC_FRACTION`` of the tokens; then each user turn quotes the first
    ``USER_QUOTE_CHARS`` characters of a paragraph and asks about it, and each
    assistant turn holds the next paragraphs' ids (as if generated) plus the
    template's closing ids. The last answer is cut so the total is exact.

    Returns:
        ``(token_ids, segments, settings)``; settings as :func:`kvchat.conversation.records.new_settings`.
    Raises:
        BenchResumeError: ``n_tokens`` too small for a prefix and one turn, or the text runs out.
    """
    from kvchat.conversation.records import new_settings
    from kvchat.engine.session import DEFAULT_SYSTEM_PROMPT
    from kvchat.model.chat_format import append_segment

    settings = new_settings(["python-docstrings.txt"])
    settings["date_string"] = "01 Jan 2025"  # fixed, so every process builds the same ids
    fmt = rt.chat_format(settings)
    paras = iter(p.strip() for p in text.split("\n\n") if p.strip())

    def encode(s: str) -> list[int]:
        return rt.tokenizer.encode(s, add_special_tokens=False)

    def take(budget: int) -> str:
        out, used = [], 0
        for p in paras:
            out.append(p)
            used += len(encode(p))
            if used >= budget:
                return "\n\n".join(out)
        raise BenchResumeError(f"the benchmark text ran out building a {n_tokens}-token chat")

    ids: list[int] = []
    segments: list = []
    doc_tokens = int(DOC_FRACTION * n_tokens)
    doc = rt.tokenizer.decode(encode(take(doc_tokens))[:doc_tokens])  # paragraphs vary: cut at the budget
    append_segment(ids, segments, "prefix", fmt.prefix_ids(DEFAULT_SYSTEM_PROMPT, [("python-docstrings.txt", doc)]))
    close = fmt.assistant_close_ids(None)
    while True:
        user = fmt.user_turn_ids(f"What does this passage mean: {take(1)[:USER_QUOTE_CHARS]}")
        answer = encode(take(256))
        left = n_tokens - len(ids) - len(user) - len(close)
        if left < 1:
            raise BenchResumeError(f"{n_tokens} tokens is too short for the prefix ({segments[0].end}) and one turn")
        last = left - len(answer) < LAST_TURN_MIN_TOKENS
        if last and len(answer) < left:
            answer += encode("\n\n" + take(left - len(answer)))
        append_segment(ids, segments, "user", user)
        append_segment(ids, segments, "assistant", (answer[:left] if last else answer) + close)
        if last:
            break
    assert len(ids) == n_tokens, (len(ids), n_tokens)
    return ids, segments, settings


# ---- children (fresh processes) ----------------------------------------------------------------

def _session(rt, spec: dict, persist=None):
    from kvchat.engine.session import Session
    from kvchat.model.chat_format import Segment

    segments = [Segment(k, a, b) for k, a, b in spec["segments"]]
    return Session(rt.engine, rt.chat_format(spec["settings"]), list(spec["ids"]), segments, persist)


def _child_build(rt, spec_path: Path, n_tokens: int, save: bool, decode_tokens: int = 0) -> dict:
    """Cold prefill of the whole chat; with ``save``, also snapshot it and time the question in memory (its answer
    ``1 + decode_tokens`` tokens long: :func:`_cold_and_in_memory`)."""
    from kvchat.engine.loop import EngineLoop
    from kvchat.texts import stdlib_text

    if not spec_path.exists():
        text = stdlib_text()
        ids, segments, settings = build_conversation(rt, n_tokens, text.text)
        rt.engine.check_fits(n_tokens + len(rt.chat_format(settings).user_turn_ids(QUESTION)) + 1)
        spec = {"ids": ids, "segments": [(s.kind, s.start, s.end) for s in segments], "settings": settings,
                "text": text.name, "text_sha256": text.sha256}
        spec_path.write_text(json.dumps(spec))
    spec = json.loads(spec_path.read_text())
    session = _session(rt, spec)
    loop = EngineLoop(rt.engine, thread=False, snapshots=False)  # the snapshot's store lives only for its save
    try:
        return _cold_and_in_memory(rt, loop, session, spec, n_tokens, save, decode_tokens)
    finally:
        loop.close()


def _cold_and_in_memory(rt, loop, session, spec: dict, n_tokens: int, save: bool, decode_tokens: int = 0) -> dict:
    """The cold prefill of ``session`` on ``loop`` and, with ``save``, its snapshot and an in-memory question,
    answered with ``1 + decode_tokens`` greedy tokens (``decode_tok_s``: the tokens after the first ÷ their time,
    at this chat's context; the snapshot is written before the question, so the answer never reaches it)."""
    import torch

    from kvchat.engine.kv_pool import KVCacheSpec
    from kvchat.engine.persistence import KVPersist, find_chain
    from kvchat.engine.sampling import SamplingParams
    from kvchat.index import get_db

    stats = loop.run(session.prefix_steps())
    out = {"from_memory": stats.from_memory, "prefilled_tokens": stats.prefilled_tokens, "cold_prefill_ms": stats.prefill_ms,
           "text": spec["text"], "text_sha256": spec["text_sha256"],
           "turns": sum(1 for s in spec["segments"] if s[0] == "user")}
    if not save:
        return out
    persist = KVPersist(rt.engine)
    session.persist = persist
    session.save_snapshot(OWNER)
    persist.close()  # its writer thread ends (with its OpenMP pool) before the timed question
    if persist.errors:
        raise BenchResumeError(persist.errors[0])
    rows = find_chain(get_db(), persist.fingerprint, spec["ids"])
    session.persist = None
    loop.run(session.turn(QUESTION, SamplingParams(max_tokens=1 + decode_tokens)))
    kv = rt.engine.spec
    f16 = KVCacheSpec(kv.num_layers, kv.num_kv_heads, kv.head_dim, "fp16")
    out.update({
        "snapshot_tokens": sum(r.token_count for r in rows), "snapshot_bytes": sum(r.bytes for r in rows),
        "snapshot_files": len(rows), "ttft_in_memory_ms": session.last_turn.stats.ttft_ms,
        "question_tokens": session.last_turn.stats.prompt_tokens - n_tokens,
        "f16_bytes": f16.bytes_per_token * n_tokens, "model": rt.info.name, "kv_dtype": rt.engine.spec.kv_dtype,
        "scale_scheme": rt.engine.scale_scheme, "device": str(rt.engine.device),
        "weights": rt.engine.weight_format, "threads": torch.get_num_threads(),
        "decode_tokens": session.last_turn.stats.new_tokens - 1,
        "decode_tok_s": session.last_turn.stats.decode_tokens_per_s or None,
    })
    return out


def _child_resume(rt, spec_path: Path, mode: str) -> dict:
    """Open the chat with the snapshot store attached and ask :data:`QUESTION` (one token)."""
    from kvchat.engine.loop import EngineLoop
    from kvchat.engine.sampling import SamplingParams

    spec = json.loads(spec_path.read_text())
    loop = EngineLoop(rt.engine, thread=False)
    persist = loop.persist
    session = _session(rt, spec, persist)
    files = [row.path for row in persist.find(spec["ids"])]
    if mode != "dropped":
        for f in files:
            read_file(f)
    resident = [drop_file_cache(f) if mode == "dropped" else resident_fraction(f) for f in files]
    loop.run(session.turn(QUESTION, SamplingParams(max_tokens=1)))
    loop.close()
    s = session.last_turn.stats
    known = [r for r in resident if r is not None]
    return {"mode": mode, "from_memory": s.from_memory, "from_disk": s.from_disk, "restore_ms": s.restore_ms,
            "bytes_read": s.bytes_read, "miss_reason": s.miss_reason, "prefilled_tokens": s.prefilled_tokens,
            "ttft_ms": s.ttft_ms, "resident_before": sum(known) / len(known) if known else None}


def child_main(argv: list[str]) -> int:
    """Entry of a benchmark child: ``ROLE SPEC_PATH N MODE MODEL KV_DTYPE THREADS DECODE_TOKENS``; prints one JSON
    line, with ``load_ms`` (:func:`kvchat.runtime.load_runtime`, wall clock) and ``peak_rss_bytes`` (the
    process's peak resident set: load, chat and all, :func:`kvchat.bench.run_info.peak_rss_bytes`)."""
    import time

    from kvchat.bench.run_info import peak_rss_bytes

    role, spec_path, n, mode, model, kv_dtype, threads, decode_tokens = argv
    from kvchat.runtime import load_runtime, set_threads

    set_threads(int(threads) or None)
    t0 = time.perf_counter()
    rt = load_runtime(model or None, kv_dtype)
    load_ms = (time.perf_counter() - t0) * 1e3
    if role == "build":
        out = _child_build(rt, Path(spec_path), int(n), mode == "save", int(decode_tokens))
    else:
        out = _child_resume(rt, Path(spec_path), mode)
    out |= {"load_ms": load_ms, "peak_rss_bytes": peak_rss_bytes()}
    print(json.dumps(out))
    return 0


def _run_child(home: Path, role: str, spec: Path, n: int, mode: str, args: argparse.Namespace) -> dict:
    env = {**os.environ, "KVCHAT_HOME": str(home)}
    argv = [*PYTHON, "-m", "kvchat.bench.resume", role, str(spec), str(n), mode, args.model or "",
            args.kv_dtype, str(args.threads or 0), str(getattr(args, "decode_tokens", 0))]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=3600, check=False)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise BenchResumeError(f"{role} child for {n} tokens failed (exit {proc.returncode}): {tail[0]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- parent ------------------------------------------------------------------------------------

def measure_read_bandwidth(directory: Path, repeats: int) -> dict:
    """Sequential read bandwidth (bytes/s) of ``directory``'s disk with the file's cache dropped, and hot."""
    path = directory / "bandwidth.bin"
    write_random_file(path, BANDWIDTH_FILE_BYTES)
    buf = bytearray(8 << 20)
    cold, hot, resident = [], [], []
    try:
        for _ in range(repeats):
            resident.append(drop_file_cache(path))
            n, s = read_file(path, buf)
            cold.append(n / s)
            n, s = read_file(path, buf)
            hot.append(n / s)
    finally:
        path.unlink(missing_ok=True)
    return {"file_bytes": BANDWIDTH_FILE_BYTES, "cold_bytes_per_s": Spread.of(cold).as_dict(0),
            "hot_bytes_per_s": Spread.of(hot).as_dict(0), "resident_after_drop": resident}


def bench_length(home: Path, n: int, args: argparse.Namespace) -> dict:
    """All processes for one chat length; returns raw samples (ms, bytes)."""
    spec = home / f"chat-{n}.json"
    builds = [_run_child(home, "build", spec, n, "save" if i == 0 else "cold", args) for i in range(args.cold_repeats)]
    first = builds[0]
    if first["snapshot_tokens"] != n:
        raise BenchResumeError(f"the snapshot covers {first['snapshot_tokens']} of {n} tokens (disk budget too small?)")
    resumes = {"dropped": [], "warm": []}
    for _ in range(args.repeats):
        for mode in ("dropped", "warm"):
            r = _run_child(home, "resume", spec, n, mode, args)
            if r["from_memory"] != 0 or r["from_disk"] != n or r["miss_reason"]:
                raise BenchResumeError(f"resume of {n} tokens ({mode}) was not a full disk restore: {r}")
            resumes[mode].append(r)
    return {"tokens": n, "builds": builds, "resumes": resumes}


def summarise(run: dict, disk: dict) -> dict:
    """Medians, spreads and ratios for one chat length."""
    n, first = run["tokens"], run["builds"][0]
    cold = [b["cold_prefill_ms"] for b in run["builds"]]
    out = {"tokens": n, "cold_prefill_ms": Spread.of(cold).as_dict(1)}
    for mode, rs in run["resumes"].items():
        restore = [r["restore_ms"] for r in rs]
        ttft = [r["ttft_ms"] for r in rs]
        out[mode] = {
            "restore_ms": Spread.of(restore).as_dict(2),
            "ttft_ms": Spread.of(ttft).as_dict(2),
            "read_gb_per_s": Spread.of([r["bytes_read"] / (r["restore_ms"] / 1e3) / 1e9 for r in rs]).as_dict(3),
            "speedup_vs_cold": ratios([Spread.of(cold).median] * len(ttft), ttft).as_dict(1),
            "resident_before": [r["resident_before"] for r in rs],
        }
    nbytes = first["snapshot_bytes"]
    children = [*run["builds"], *(r for rs in run["resumes"].values() for r in rs)]
    out.update({
        "load_ms": Spread.of([c["load_ms"] for c in children]).as_dict(0),
        "peak_rss_bytes": max(c["peak_rss_bytes"] for c in children),
        "peak_rss_bytes_chat": first["peak_rss_bytes"], "decode_tok_s": first.get("decode_tok_s"),
        "snapshot_bytes": nbytes, "snapshot_files": first["snapshot_files"], "bytes_per_token": nbytes / n,
        "vs_f16": nbytes / first["f16_bytes"], "ttft_in_memory_ms": first["ttft_in_memory_ms"],
        "question_tokens": first["question_tokens"],
        "disk_floor_ms": nbytes / disk["cold_bytes_per_s"]["median"] * 1e3,
        "page_cache_floor_ms": nbytes / disk["hot_bytes_per_s"]["median"] * 1e3,
    })
    return out


def _table(summaries: list[dict]) -> str:
    rows = [("tokens", "cold prefill ms", "restore ms warm", "restore ms dropped", "TTFT ms warm", "TTFT ms dropped",
             "cold/TTFT (dropped)", "TTFT in memory", "snapshot MB", "B/token", "vs f16", "read GB/s warm/dropped",
             "floor ms cache/disk")]
    f = lambda d, k=1: f"{d['median']:.{k}f} ({d['min']:.{k}f}-{d['max']:.{k}f})"  # noqa: E731
    for s in summaries:
        w, d = s["warm"], s["dropped"]
        rows.append((
            str(s["tokens"]), f(s["cold_prefill_ms"], 0), f(w["restore_ms"]), f(d["restore_ms"]), f(w["ttft_ms"]),
            f(d["ttft_ms"]), f"{d['speedup_vs_cold']['median']:.0f}x", f"{s['ttft_in_memory_ms']:.1f}",
            f"{s['snapshot_bytes'] / 1e6:.1f}", f"{s['bytes_per_token']:.0f}", f"{s['vs_f16']:.3f}",
            f"{w['read_gb_per_s']['median']:.2f} / {d['read_gb_per_s']['median']:.2f}",
            f"{s['page_cache_floor_ms']:.1f} / {s['disk_floor_ms']:.1f}",
        ))
    return format_table(rows)


def process_line(summary: dict) -> str:
    """One line of what a chat length's fresh processes took: model load (ms), peak resident set (the chat's
    process and the largest of all), and the decode rate of the in-memory answer when it had more than a token."""
    load = summary["load_ms"]
    line = (f"{summary['tokens']} tokens: load {load['median']:.0f} ms ({load['min']:.0f}-{load['max']:.0f}), peak RSS "
            f"{summary['peak_rss_bytes_chat'] / 2**30:.2f} GiB (chat process), {summary['peak_rss_bytes'] / 2**30:.2f} "
            "GiB (largest process)")
    if summary.get("decode_tok_s"):
        line += f", decode {summary['decode_tok_s']:.2f} tok/s after the question"
    return line


def dropped_restore_verdicts(summaries: list[dict]) -> list[str]:
    """One line per chat of >= TARGETS["tokens"] tokens: dropped-cache restore vs the disk-floor allowance."""
    lines = []
    for s in summaries:
        if s["tokens"] < TARGETS["tokens"]:
            continue
        allowed = TARGETS["dropped_floor_factor"] * s["disk_floor_ms"] + TARGETS["dropped_slack_ms"]
        got = s["dropped"]["restore_ms"]["median"]
        lines.append(f"{s['tokens']} tokens: restore dropped {got:.1f} ms <= {TARGETS['dropped_floor_factor']}x floor "
                     f"{s['disk_floor_ms']:.1f} + {TARGETS['dropped_slack_ms']:.0f} = {allowed:.1f} ms: "
                     f"{'met' if got <= allowed else 'MISSED'}")
    return lines


def _verdicts(summaries: list[dict]) -> list[str]:
    t = next((s for s in summaries if s["tokens"] == TARGETS["tokens"]), None)
    if t is None:
        return [f"targets are stated for {TARGETS['tokens']} tokens; not measured in this run"]
    ok = lambda b: "met" if b else "MISSED"  # noqa: E731
    ttft = max(t["warm"]["ttft_ms"]["median"], t["dropped"]["ttft_ms"]["median"])
    speed = min(t["warm"]["speedup_vs_cold"]["median"], t["dropped"]["speedup_vs_cold"]["median"])
    return [
        f"restore warm {t['warm']['restore_ms']['median']:.1f} ms <= {TARGETS['restore_warm_ms']:.0f} ms: "
        f"{ok(t['warm']['restore_ms']['median'] <= TARGETS['restore_warm_ms'])}",
        f"TTFT {ttft:.1f} ms (worse of warm/dropped) <= {TARGETS['ttft_ms']:.0f} ms: {ok(ttft <= TARGETS['ttft_ms'])}",
        f"cold prefill / TTFT {speed:.0f}x >= {TARGETS['ttft_speedup']:.0f}x: {ok(speed >= TARGETS['ttft_speedup'])}",
        f"snapshot {t['vs_f16']:.3f}x of f16 <= {TARGETS['bytes_vs_f16']}x: {ok(t['vs_f16'] <= TARGETS['bytes_vs_f16'])}",
        *dropped_restore_verdicts(summaries),
    ]


def run_resume(args: argparse.Namespace, *, quick: bool = False) -> dict:
    """Run the benchmark (fresh processes, temporary data dir beside the real one); the JSON-ready result.

    Keys: ``summary`` (per length: ``cold_prefill_ms``, ``warm``/``dropped``
    ``restore_ms`` and ``ttft_ms`` spreads, ``disk_floor_ms``,
    ``page_cache_floor_ms``, snapshot bytes), ``runs`` (raw samples), ``disk``,
    ``run`` (:func:`kvchat.bench.run_info.run_info`; ``quick`` recorded there).

    Raises:
        ValueError: bad ``--tokens``/``--repeats``/``--cold-repeats``.
        BenchResumeError: a child failed, or a resume was not a full disk restore.
    """
    from kvchat.bench.run_info import run_info
    from kvchat.paths import data_dir

    tokens = args.tokens or list(DEFAULT_TOKENS)
    if min(tokens) < 256 or args.repeats < 1 or args.cold_repeats < 1:
        raise ValueError("--tokens must be >= 256 and --repeats/--cold-repeats >= 1")
    # The snapshot goes where kvchat keeps snapshots, so the disk measured is the one users resume from.
    with tempfile.TemporaryDirectory(prefix="bench-resume-", dir=data_dir()) as tmp:
        home = Path(tmp)
        disk = measure_read_bandwidth(home, args.repeats)
        runs = []
        for n in tokens:
            print(f"resume bench: {n} tokens ...", file=sys.stderr, flush=True)
            runs.append(bench_length(home, n, args))
    summaries = [summarise(r, disk) for r in runs]
    first = runs[0]["builds"][0]
    return {"benchmark": "resume", "run": run_info(threads=first["threads"], quick=quick),
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": platform.platform(),
            "cpus": os.cpu_count(), "repeats": args.repeats, "cold_repeats": args.cold_repeats, "disk": disk,
            "summary": summaries, "runs": runs, "targets": TARGETS, "llama_cpp_reference": LLAMA_CPP_REFERENCE,
            "question": QUESTION}


def format_report(result: dict) -> str:
    """The header lines, the table, the llama.cpp reference line and the verdicts of a :func:`run_resume` result."""
    runs, disk, summaries = result["runs"], result["disk"], result["summary"]
    first = runs[0]["builds"][0]
    lines = []
    lines.append(f"kvchat resume: model {first['model']} · {first.get('weights', 'fp32')} weights (the default format) · "
                 f"KV {first['kv_dtype']} ({first['scale_scheme']}) · {first['device']} · "
                 f"{first['threads']} threads · text {first['text']} (sha256 {first['text_sha256'][:12]}) · "
                 f"question {first['question_tokens']} tokens · {result['repeats']} repeats (cold: {result['cold_repeats']})")
    lines.append(f"disk: sequential read {disk['cold_bytes_per_s']['median'] / 1e9:.2f} GB/s cache dropped, "
                 f"{disk['hot_bytes_per_s']['median'] / 1e9:.2f} GB/s from the page cache ({BANDWIDTH_FILE_BYTES >> 20} MiB file)")
    lines.append(_table(summaries))
    lines += [process_line(s) for s in summaries]
    ref = LLAMA_CPP_REFERENCE
    lines.append(f"llama.cpp reference (not this run): {ref['tokens']} tokens, {ref['state_bytes'] / 1e6:.0f} MB f16 state, "
                 f"{ref['resume_plus_question_ms']:.0f} ms resume + {ref['question_tokens']}-token question, "
                 f"{ref['cold_prefill_ms'] / 1e3:.0f} s cold ({ref['cold_prefill_ms'] / ref['resume_plus_question_ms']:.0f}x)")
    warning = kept_pages_warning(disk["resident_after_drop"] + [
        r for s in summaries for r in s["dropped"]["resident_before"]])
    lines.extend(([warning] if warning else []) + _verdicts(summaries))
    return "\n".join(lines)


def cmd_bench_resume(args: argparse.Namespace) -> int:
    """``kvchat bench resume``: run it (:func:`run_resume`), print the report, write ``args.json`` if set. Returns 0."""
    result = run_resume(args)
    print(format_report(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
