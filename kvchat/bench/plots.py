"""PNG plots of benchmark JSON (matplotlib, the optional ``plots`` extra).

Each plot reads one benchmark's JSON as written by ``kvchat bench all`` and
saves one PNG; a JSON that lacks the benchmark (it was skipped or failed)
simply gets no plot. Every plot's footer names the machine, date, commit and
whether it was a ``--quick`` run, from the JSON's ``run`` block.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

PLOTS_MISSING = "plots skipped: matplotlib is not installed (pip install 'kvchat[plots]')"


def have_matplotlib() -> bool:
    """True when matplotlib can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _footer(fig, res: dict) -> None:
    run = res.get("run") or {}
    m, git = run.get("machine") or {}, run.get("git") or {}
    commit = (git.get("commit") or "no git")[:10] + ("+dirty" if git.get("dirty") else "")
    text = (f"{m.get('cpu_model', '?')}, {m.get('threads', '?')} threads of {m.get('usable_cores', '?')} cores · "
            f"{run.get('date_utc', '?')} · {commit}" + (" · QUICK run (small settings)" if run.get("quick") else ""))
    fig.text(0.01, 0.01, text, fontsize=7, color="0.4")


def plot_resume(res: dict, ax_pair) -> None:
    """TTFT and restore_ms (ms, log scale) vs conversation length: cold, warm, page cache dropped, disk floor."""
    s = sorted(res["summary"], key=lambda r: r["tokens"])
    n = [r["tokens"] for r in s]
    ttft, restore = ax_pair
    ttft.plot(n, [r["cold_prefill_ms"]["median"] for r in s], "o-", label="cold prefill (no cache)")
    ttft.plot(n, [r["warm"]["ttft_ms"]["median"] for r in s], "s-", label="resume, page cache warm")
    ttft.plot(n, [r["dropped"]["ttft_ms"]["median"] for r in s], "^-", label="resume, page cache dropped")
    ttft.plot(n, [r["ttft_in_memory_ms"] for r in s], "x:", label="chat still in the pool")
    ttft.set_title(f"time to first token after a {s[0]['question_tokens']}-token question")
    restore.plot(n, [r["warm"]["restore_ms"]["median"] for r in s], "s-", label="restore, page cache warm")
    restore.plot(n, [r["dropped"]["restore_ms"]["median"] for r in s], "^-", label="restore, page cache dropped")
    restore.plot(n, [r["disk_floor_ms"] for r in s], "k--", label="disk floor (bytes / seq. read)")
    restore.plot(n, [r["page_cache_floor_ms"] for r in s], "k:", label="page-cache floor")
    restore.set_title("restore_ms: snapshot read + check + copy into the pool")
    for ax in ax_pair:
        ax.set_xlabel("conversation length (tokens)")
        ax.set_ylabel("ms (median)")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)


def plot_engine(res: dict, ax_pair) -> None:
    """Prefill and decode tokens/s per backend and context (median bars, min-max error bars)."""
    backends = list(dict.fromkeys(r["backend"] for r in res["runs"]))
    contexts = sorted({r["context"] for r in res["runs"]})
    width = 0.8 / len(backends)
    for ax, phase in zip(ax_pair, ("prefill", "decode")):
        for i, b in enumerate(backends):
            runs = {r["context"]: r[f"{phase}_tok_s"] for r in res["runs"] if r["backend"] == b}
            med = [runs[c]["median"] for c in contexts]
            err = [[runs[c]["median"] - runs[c]["min"] for c in contexts], [runs[c]["max"] - runs[c]["median"] for c in contexts]]
            ax.bar([j + i * width for j in range(len(contexts))], med, width, yerr=err, capsize=3, label=b)
        ax.set_xticks([j + width * (len(backends) - 1) / 2 for j in range(len(contexts))], [f"@{c}" for c in contexts])
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("tokens/s (median, min-max)")
        ax.set_title(f"{phase}, {res['threads']} threads, {res['compute_dtype']} compute")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)


def plot_memory(res: dict, ax_pair) -> None:
    """Bytes per token per KV dtype (K+V and scales stacked), and 4096-token chats that fit per budget."""
    per, fit = ax_pair
    pools = res["pools"]
    names = [p["kv_dtype"] for p in pools]
    kv = [p["kv_bytes_per_token"] for p in pools]
    sc = [p["scale_bytes_per_token"] for p in pools]
    per.bar(names, kv, label="K + V values")
    per.bar(names, sc, bottom=kv, label="fp32 scales")
    for i, p in enumerate(pools):
        per.text(i, p["bytes_per_token"], f"{p['bytes_per_token']:,.0f}", ha="center", va="bottom", fontsize=8)
    per.set_ylim(0, 1.12 * max(p["bytes_per_token"] for p in pools))
    per.set_ylabel("bytes per token (all layers), from the allocated pool")
    per.set_title(f"{res['model']}: KV bytes per token")
    per.legend(fontsize=8)
    budgets = sorted({f["budget_bytes"] for f in res["chats_that_fit"]})
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        rows = {f["budget_bytes"]: f["chats_block_manager"] for f in res["chats_that_fit"] if f["kv_dtype"] == name}
        fit.bar([j + i * width for j in range(len(budgets))], [rows[b] for b in budgets], width, label=name)
    chat = res["chats_that_fit"][0]["chat_tokens"]
    fit.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(budgets))], [f"{b / 2**30:g} GiB" for b in budgets])
    fit.set_ylabel(f"{chat}-token chats that fit (BlockManager)")
    w = res["paged_waste"]
    fit.set_title(f"paged waste over {w['chats']} mixed chats: {w['internal_waste_pct']:.1f}% "
                  f"(contiguous max-context: {w['contiguous_waste_pct']:.0f}%)", fontsize=9)
    fit.legend(fontsize=8)


def plot_retrieval(res: dict, ax_pair) -> None:
    """Per-token probability of the planted fact's value per depth and pool (control: no fact); fp8 − bf16 log p."""
    r = res["retrieval"]
    rows = [x for x in r["rows"] if x["depth"] is not None]
    control = next(x for x in r["rows"] if x["depth"] is None)
    depths = [f"{x['depth']:.0%}" for x in rows]
    lp, diff = ax_pair
    width = 0.8 / len(r["pools"])
    for i, kv in enumerate(r["pools"]):
        lp.bar([j + i * width for j in range(len(rows))], [x[kv]["value_prob"] for x in rows], width, label=kv)
        lp.axhline(control[kv]["value_prob"], ls=":", color=f"C{i}", label=f"{kv} control (no fact)")
    lp.set_xticks([j + width * (len(r["pools"]) - 1) / 2 for j in range(len(rows))], depths)
    lp.set_ylim(0, 1.3)
    lp.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    lp.set_xlabel("depth of the fact in the document")
    lp.set_ylabel("p per value token (geometric mean), teacher-forced")
    lp.set_title(f"retrieval of {r['value']!r} in {r['doc_tokens_requested']} tokens", fontsize=10)
    lp.legend(fontsize=8, ncol=2, loc="upper center")
    ref = r["reference_pool"]
    for kv in r["pools"][1:]:
        diff.bar(depths, [x[f"{kv}_minus_{ref}"] for x in rows], label=f"{kv} − {ref}")
    diff.axhline(0, color="k", lw=0.8)
    diff.set_xlabel("depth of the fact in the document")
    diff.set_ylabel("Δ log p, nats (negative = fp8 loses)")
    diff.set_title("fp8 pool vs bf16 pool")
    diff.legend(fontsize=8)


def plot_peers(res: dict, ax_pair) -> None:
    """kvchat vs llama.cpp: tokens/s (prefill, decode) and resume TTFT of the same conversation."""
    speed, ttft = ax_pair
    rows = res["speed"]
    names = [r["backend"] for r in rows]
    width = 0.4
    speed.bar([i - width / 2 for i in range(len(rows))], [r["prefill_tok_s"]["median"] for r in rows], width, label="prefill")
    speed.bar([i + width / 2 for i in range(len(rows))], [r["decode_tok_s"]["median"] for r in rows], width, label="decode")
    speed.set_xticks(range(len(rows)), names, fontsize=8)
    speed.set_yscale("log")
    speed.set_ylabel("tokens/s (median)")
    speed.set_title(f"@{res['context']} tokens, {res['threads']} threads")
    speed.legend(fontsize=8)
    r = res["resume"]
    if not r:
        ttft.set_axis_off()
        return
    rows = r["rows"][::-1]
    ttft.barh([x["who"] for x in rows], [x["ttft_ms"]["median"] for x in rows],
              color=["C0" if x["who"].startswith("kvchat") else "C3" for x in rows])
    ttft.set_xscale("log")
    ttft.xaxis.set_minor_formatter("")  # decades only: minor labels collide
    ttft.set_xlabel("time to first token, ms (median)")
    ttft.set_title(f"resume a {r['tokens']}-token chat + a {r['question_tokens']}-token question", fontsize=9)
    ttft.tick_params(axis="y", labelsize=8)


PLOTS: dict[str, tuple[str, Callable, Callable[[dict], bool]]] = {
    "resume": ("resume_curve.png", plot_resume, lambda r: bool(r.get("summary"))),
    "engine": ("engine_tok_s.png", plot_engine, lambda r: bool(r.get("runs"))),
    "memory": ("memory_bytes_per_token.png", plot_memory, lambda r: bool(r.get("pools"))),
    "fidelity": ("retrieval_by_depth.png", plot_retrieval, lambda r: bool(r.get("retrieval"))),
    "peers": ("peers_llama_cpp.png", plot_peers, lambda r: bool(r.get("speed"))),
}


def write_plots(results: dict[str, dict], out: Path) -> list[Path] | None:
    """One PNG per benchmark in ``results`` (name -> its JSON) that has a plot; None without matplotlib.

    Returns:
        the paths written (benchmarks without data, or with an ``error``, get none).
    """
    if not have_matplotlib():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for name, res in results.items():
        if name not in PLOTS or res.get("error") or not PLOTS[name][2](res):
            continue
        filename, draw, _ = PLOTS[name]
        fig, axes = plt.subplots(1, 2, figsize=(13, 5))
        draw(res, axes)
        fig.suptitle(f"kvchat bench {name}")
        fig.tight_layout(rect=(0, 0.03, 1, 0.97))
        _footer(fig, res)
        path = out / filename
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
