"""``kvchat bench serve``: the server through its HTTP API, as a client sees it.

A real ``kvchat serve`` child process on loopback (a fresh data dir), driven
with the standard library's HTTP client (streaming requests, Server-Sent
Events parsed here), greedy:

- **TTFT of turn N** of a long conversation (the history given as messages,
  ``--history-tokens`` of stdlib docstrings split into turns): *cold* (the
  first request, everything prefilled), *warm* (the next turn, the history in
  the pool) and *after a restart* (the turn after, in a new server process:
  from disk). TTFT = request sent → first content delta, at the client.
- **Aggregate decode tokens/s** with 1, 2, 4 and 8 concurrent streams (each
  its own prompt, ``--decode-tokens`` per answer): the streams' completion
  tokens after their first ÷ the time from the first stream's first token to
  the last stream's end (and, "all streams decoding", the deltas between the
  last stream's first token and the first stream's end ÷ that time); and p50/p99 of the time between consecutive deltas
  of a stream (one delta per token, a piece that ends inside a character
  excepted). Target: ≥ 2.5× one stream's aggregate at 4 streams.
  The stream counts run ``--repeats`` rounds in one server; each round's ratios are taken against that
  round's one stream (side by side), and the table gives medians with the rounds' range.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import tempfile
import threading
import time

from kvchat.bench import PYTHON
from kvchat.bench.stats import format_table

RUN = "import sys; from kvchat.cli.main import main; sys.exit(main(sys.argv[1:]))"
TOPICS = ("a lighthouse", "a dragon", "the sea", "a robot", "a garden", "a city", "a storm", "a library")
STREAMS = (1, 2, 4, 8)


def add_serve_bench_args(p: argparse.ArgumentParser) -> None:
    """The ``kvchat bench serve`` options."""
    p.add_argument("--history-tokens", type=int, default=2048, help="approximate tokens of the long conversation")
    p.add_argument("--decode-tokens", type=int, default=96, help="tokens per answer in the concurrency runs")
    p.add_argument("--streams", type=int, nargs="+", default=list(STREAMS), help="concurrent streams to measure")
    p.add_argument("--repeats", type=int, default=3, help="rounds of the concurrency runs (medians reported)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")


class _Server:
    def __init__(self, home: str, model: str | None, kv_dtype: str, threads: int | None):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        args = ["serve", "--port", str(self.port), "--kv-dtype", kv_dtype]
        args += ["--model", model] if model else []
        args += ["--threads", str(threads)] if threads else []
        self.proc = subprocess.Popen([*PYTHON, "-c", RUN, *args], env={**os.environ, "KVCHAT_HOME": home},
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 300
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvchat serve exited: {self.proc.stderr.read()}")
            try:
                self.model = self.get("/v1/models")["data"][0]["id"]
                return
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.3)

    def get(self, path: str) -> dict:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        conn.request("GET", path)
        return json.loads(conn.getresponse().read())

    def stream(self, messages: list[dict], max_tokens: int) -> dict:
        """One streaming chat completion: its text, TTFT, delta times, usage and kvchat block."""
        body = json.dumps({"model": self.model, "messages": messages, "temperature": 0, "max_tokens": max_tokens,
                           "stream": True, "stream_options": {"include_usage": True}})
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        t0 = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
        out = {"text": "", "times": [], "t0": t0, "usage": None, "kvchat": None}
        for line in resp:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:  # a failed or cut stream ends so, without [DONE]
                raise RuntimeError(f"the stream ended with an error: {chunk['error']['message']}")
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                out["times"].append(time.perf_counter())
                out["text"] += chunk["choices"][0]["delta"]["content"]
            out["usage"] = chunk.get("usage") or out["usage"]
            out["kvchat"] = chunk.get("kvchat") or out["kvchat"]
        out["end"] = time.perf_counter()
        out["ttft_ms"] = ((out["times"][0] if out["times"] else out["end"]) - t0) * 1e3
        conn.close()
        return out

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(120)


def _history(tokens: int) -> list[dict]:
    """A long conversation: stdlib docstrings as alternating user/assistant messages (~4 characters a token)."""
    from kvchat.texts import stdlib_text

    text = stdlib_text().text[: tokens * 4]
    pieces = [text[i : i + 1200] for i in range(0, len(text), 1200)]
    msgs = [{"role": "system", "content": "You answer questions about Python's standard library."}]
    for k, piece in enumerate(pieces):
        msgs.append({"role": "user" if k % 2 == 0 else "assistant", "content": piece})
    if msgs[-1]["role"] == "user":
        msgs.append({"role": "assistant", "content": "Noted."})
    return msgs


def _turn_row(name: str, r: dict) -> dict:
    u, k = r["usage"], r["kvchat"]
    return {"turn": name, "prompt_tokens": u["prompt_tokens"], "cached_tokens": u["prompt_tokens_details"]["cached_tokens"],
            "from_memory": k["from_memory"], "from_disk": k["from_disk"], "prefilled_tokens": k["prefilled_tokens"],
            "restore_ms": k["restore_ms"], "ttft_ms": round(r["ttft_ms"], 1), "server_ttft_ms": k["ttft_ms"]}


def _concurrent(srv: _Server, n: int, decode_tokens: int) -> dict:
    results: list[dict] = [None] * n

    def one(i):
        results[i] = srv.stream([{"role": "user", "content": f"Write a long story about {TOPICS[i % len(TOPICS)]}."}],
                                decode_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = min(r["times"][0] for r in results if r["times"])
    end = max(r["end"] for r in results)
    tokens = sum(max(r["usage"]["completion_tokens"] - 1, 0) for r in results)
    lo, hi = max(r["times"][0] for r in results if r["times"]), min(r["end"] for r in results)
    steady = sum(lo < t <= hi for r in results for t in r["times"])  # deltas while all n streams decode
    gaps = sorted(b - a for r in results for a, b in zip(r["times"], r["times"][1:]))
    pick = (lambda q: gaps[min(len(gaps) - 1, int(q * len(gaps)))] * 1e3) if gaps else (lambda q: float("nan"))
    return {"streams": n, "decode_tokens": tokens, "wall_s": round(end - first, 3),
            "aggregate_tokens_per_s": round(tokens / max(end - first, 1e-9), 2),
            "steady_tokens_per_s": round(steady / (hi - lo), 2) if hi > lo and steady else None,
            "p50_ms_per_token": round(statistics.median(gaps) * 1e3, 1) if gaps else None,
            "p99_ms_per_token": round(pick(0.99), 1)}


def run_serve(ns: argparse.Namespace, quick: bool = False) -> dict:
    """Run the benchmark (see module doc); returns the JSON-ready result."""
    from kvchat.bench.run_info import run_info

    model, kv_dtype, threads = getattr(ns, "model", None), getattr(ns, "kv_dtype", None) or "fp8", getattr(ns, "threads", None)
    if ns.repeats < 1 or ns.decode_tokens < 1 or min(ns.streams) < 1:
        raise ValueError("--repeats, --decode-tokens and --streams must be positive")
    home = tempfile.mkdtemp(prefix="kvchat-bench-serve-")
    msgs = _history(ns.history_tokens)
    srv = _Server(home, model, kv_dtype, threads)
    try:
        turns = []
        cold = srv.stream(msgs + [{"role": "user", "content": "Which module did the first message describe?"}], 16)
        turns.append(_turn_row("cold", cold))
        msgs += [{"role": "user", "content": "Which module did the first message describe?"},
                 {"role": "assistant", "content": cold["text"]}]
        warm = srv.stream(msgs + [{"role": "user", "content": "Name one function it has."}], 16)
        turns.append(_turn_row("warm (in memory)", warm))
        msgs += [{"role": "user", "content": "Name one function it has."}, {"role": "assistant", "content": warm["text"]}]
        srv.stream([{"role": "user", "content": "Hello."}], 4)  # warm-up of the concurrency runs' path
        rounds = [[_concurrent(srv, n, ns.decode_tokens) for n in ns.streams] for _ in range(ns.repeats)]
    finally:
        srv.stop()
    srv = _Server(home, model, kv_dtype, threads)
    try:
        again = srv.stream(msgs + [{"role": "user", "content": "And one class?"}], 16)
        turns.append(_turn_row("after restart (disk)", again))
    finally:
        srv.stop()
    for rnd in rounds:  # ratios within a round: its runs are side by side
        one = rnd[0] if rnd and rnd[0]["streams"] == 1 else None
        for row in rnd:
            for key in ("aggregate_tokens_per_s", "steady_tokens_per_s"):
                base = one and one[key]
                row[key.replace("tokens_per_s", "vs_one_stream")] = round(row[key] / base, 2) if base and row[key] else None
    concurrency = [_median_row([rnd[k] for rnd in rounds]) for k in range(len(ns.streams))]
    return {"benchmark": "serve", "run": run_info(threads=threads, quick=quick), "history_tokens": ns.history_tokens,
            "turns": turns, "concurrency": concurrency, "rounds": rounds}


def _median_row(runs: list[dict]) -> dict:
    """One stream count over the rounds: each figure's median, and the ratios' range (``…_range``)."""
    row = {"streams": runs[0]["streams"], "round_count": len(runs)}
    for key in runs[0]:
        if key == "streams":
            continue
        values = [r[key] for r in runs if r[key] is not None]
        row[key] = round(statistics.median(values), 2) if values else None
        if key.endswith("vs_one_stream") and values:
            row[key + "_range"] = [min(values), max(values)]
    return row


def format_report(res: dict) -> str:
    """The two tables and the 4-stream verdict."""
    t = [["turn", "prompt", "cached", "memory", "disk", "prefilled", "restore ms", "TTFT ms (client)", "TTFT ms (server)"]]
    t += [[r["turn"], str(r["prompt_tokens"]), str(r["cached_tokens"]), str(r["from_memory"]), str(r["from_disk"]),
           str(r["prefilled_tokens"]), f"{r['restore_ms']:.1f}", f"{r['ttft_ms']:.0f}", f"{r['server_ttft_ms']:.0f}"]
          for r in res["turns"]]
    c = [["streams", "decode tokens", "aggregate tok/s", "× one stream", "all streams decoding: tok/s", "× one stream",
          "p50 ms/token", "p99 ms/token"]]
    c += [[str(r["streams"]), f"{r['decode_tokens']:.0f}", f"{r['aggregate_tokens_per_s']:.1f}", _ratio(r, "aggregate"),
           str(r["steady_tokens_per_s"]), _ratio(r, "steady"), str(r["p50_ms_per_token"]),
           str(r["p99_ms_per_token"])] for r in res["concurrency"]]
    four = next((r for r in res["concurrency"] if r["streams"] == 4), None)
    verdict = "" if four is None or four["aggregate_vs_one_stream"] is None else (
        f"\n4 streams: {_ratio(four, 'aggregate')}× one stream's aggregate, median of {four['round_count']} rounds "
        f"(goal ≥ 2.5×: {'met' if four['aggregate_vs_one_stream'] >= 2.5 else 'missed'}); "
        f"{_ratio(four, 'steady')}× while all 4 decode (the first tokens wait for the others' prefill)")
    head = f"medians of {res['concurrency'][0]['round_count']} rounds; × one stream: per round, (min-max)\n" if res["concurrency"] else ""
    return format_table(t) + "\n\n" + head + format_table(c) + verdict


def _ratio(row: dict, kind: str) -> str:
    """``median (min-max)`` of a row's per-round ratio to one stream."""
    value, spread = row[f"{kind}_vs_one_stream"], row.get(f"{kind}_vs_one_stream_range")
    if value is None:
        return "None"
    return f"{value} ({spread[0]}-{spread[1]})" if spread and spread[0] != spread[1] else str(value)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    """``kvchat bench serve``: print the tables (and write ``--json``)."""
    from kvchat.bench.run_info import print_report

    res = run_serve(args)
    return print_report(res, format_report(res), args.json)
