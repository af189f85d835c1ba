"""``kvchat bench memory``: KV bytes per token per pool dtype, chats that fit a budget, paged waste.

Unlike ``kvchat plan`` (arithmetic from the config), every figure here is
measured from the real objects:

- bytes per token: a :class:`kvchat.engine.kv_pool.KVPool` is allocated per dtype
  (fp8 / bf16 / fp16) and ``pool.nbytes / pool.capacity_tokens`` is taken from
  its tensors (K, V and, for fp8, the fp32 per-token, per-KV-head scales);
  the formula (:attr:`KVCacheSpec.bytes_per_token`) is reported beside it;
- chats that fit: for each budget, the blocks a pool of that budget holds
  (budget ÷ measured bytes per block, as :meth:`KVPool.from_budget` sizes
  it), then a real :class:`kvchat.engine.block_manager.BlockManager` with that many
  blocks is filled with ``--chat-tokens``-token chats of distinct tokens until
  it reports :class:`PoolFullError`;
- paged waste: :mod:`kvchat.bench.paged_waste` (a mix of chat lengths run
  through the real BlockManager).
"""

from __future__ import annotations

import argparse
import math
import random

from kvchat.bench.paged_waste import DEFAULT_MIX_CHATS, measure_paged_waste
from kvchat.bench.run_info import print_report, run_info
from kvchat.bench.stats import format_table
from kvchat.engine.cache_identity import KV_DTYPE_NAMES

MEASURE_BLOCKS = 64  # blocks of the pool allocated to measure bytes/token (the ratio does not depend on size)
DEFAULT_BUDGETS_GIB = (0.5, 16.0)  # the CPU pool default (KVCHAT_KV_BUDGET_MB 512) and a 16 GiB accelerator's share
DEFAULT_CHAT_TOKENS = 4096
GIB = 2**30


def add_memory_args(p: argparse.ArgumentParser) -> None:
    """The ``kvchat bench memory`` options (the CLI adds ``--model``/``--kv-dtype``/``--threads``)."""
    p.add_argument("--budget-gib", type=float, action="append", metavar="GIB",
                   help="KV pool budget in GiB (repeatable; default 0.5 and 16)")
    p.add_argument("--chat-tokens", type=int, default=DEFAULT_CHAT_TOKENS, help="tokens per chat for 'chats that fit'")
    p.add_argument("--mix-chats", type=int, default=DEFAULT_MIX_CHATS, help="chats in the paged-waste mix")
    p.add_argument("--seed", type=int, default=0, help="seed of the chat-length mix")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")


def measure_pool(cfg, kv_dtype: str, num_blocks: int = MEASURE_BLOCKS) -> dict:
    """Allocate a ``num_blocks``-block CPU pool of ``kv_dtype`` and measure it.

    Returns:
        ``{kv_dtype, blocks, pool_nbytes, capacity_tokens, bytes_per_token,
        kv_bytes_per_token, scale_bytes_per_token, bytes_per_block,
        formula_bytes_per_token}`` (bytes; per token = all layers, K + V).
    """
    from kvchat.engine.kv_pool import KVCacheSpec, KVPool

    spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv_dtype)
    pool = KVPool(spec, num_blocks, "cpu")
    tokens = pool.capacity_tokens
    kv = sum(t.numel() * t.element_size() for t in (pool.k, pool.v))
    scales = sum(t.numel() * t.element_size() for t in (pool.k_scale, pool.v_scale) if t is not None)
    out = {
        "kv_dtype": kv_dtype, "blocks": num_blocks, "pool_nbytes": pool.nbytes, "capacity_tokens": tokens,
        "bytes_per_token": pool.nbytes / tokens, "kv_bytes_per_token": kv / tokens,
        "scale_bytes_per_token": scales / tokens, "bytes_per_block": pool.nbytes / num_blocks,
        "formula_bytes_per_token": spec.bytes_per_token,
    }
    del pool
    return out


def chats_that_fit(block_bytes: float, budget_bytes: int, chat_tokens: int, block_size: int) -> dict:
    """Chats of ``chat_tokens`` that a pool of ``budget_bytes`` holds, counted by a real BlockManager.

    Args:
        block_bytes: measured bytes of one block (all layers, K + V + scales).
        budget_bytes: the pool budget, bytes.
        chat_tokens: tokens per chat.
        block_size: tokens per block.
    Returns:
        ``{budget_bytes, blocks, chat_tokens, chats_arithmetic, chats_block_manager}``.
    """
    from kvchat.engine.block_manager import BlockManager, PoolFullError, SeqBlocks

    blocks = max(1, int(budget_bytes // block_bytes))
    arithmetic = blocks // math.ceil(chat_tokens / block_size)
    bm = BlockManager(blocks, block_size, salt=b"bench-memory")
    rng = random.Random(blocks)
    fitted = 0
    while True:
        seq = SeqBlocks()
        ids = [rng.randrange(1 << 30) for _ in range(chat_tokens)]  # distinct chats: no prefix sharing
        try:
            bm.reserve(seq, chat_tokens)
        except PoolFullError:
            break
        bm.commit(seq, ids, chat_tokens)
        fitted += 1
    return {"budget_bytes": budget_bytes, "blocks": blocks, "chat_tokens": chat_tokens,
            "chats_arithmetic": arithmetic, "chats_block_manager": fitted}


def run_memory(args: argparse.Namespace, *, quick: bool = False) -> dict:
    """Everything ``kvchat bench memory`` reports, JSON-ready (bytes unless named).

    Raises:
        ValueError: non-positive budget, chat tokens or mix size.
    """
    from kvchat.engine.kv_pool import BLOCK_SIZE
    from kvchat.model.registry import resolve_model
    from kvchat.runtime import set_threads

    budgets = args.budget_gib or list(DEFAULT_BUDGETS_GIB)
    if min(budgets) <= 0 or args.chat_tokens < 1 or args.mix_chats < 1:
        raise ValueError("--budget-gib, --chat-tokens and --mix-chats must be positive")
    set_threads(args.threads)  # the pools are allocated (zeroed) with torch's threads
    info = resolve_model(args.model)
    cfg = info.config
    pools = [measure_pool(cfg, kv) for kv in KV_DTYPE_NAMES]
    fp16 = next(p for p in pools if p["kv_dtype"] == "fp16")
    for p in pools:
        p["vs_fp16"] = p["bytes_per_token"] / fp16["bytes_per_token"]
    fit = [{"kv_dtype": p["kv_dtype"], **chats_that_fit(p["bytes_per_block"], int(b * GIB), args.chat_tokens, BLOCK_SIZE)}
           for b in budgets for p in pools]
    waste = measure_paged_waste(args.mix_chats, args.seed, cfg.max_position_embeddings, BLOCK_SIZE)
    fp8 = pools[0]["bytes_per_token"]
    waste["fp8_bytes"] = {k: waste[k] * fp8 for k in ("allocated_slots", "filled_slots", "internal_waste_slots",
                                                      "contiguous_max_context_slots")}
    return {
        "benchmark": "memory",
        "run": run_info(quick=quick),
        "model": info.name,
        "config": {"num_layers": cfg.num_layers, "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
                   "block_size": BLOCK_SIZE, "max_context": cfg.max_position_embeddings},
        "pools": pools,
        "chats_that_fit": fit,
        "paged_waste": waste,
    }


def format_report(res: dict) -> str:
    """Human-readable tables of a :func:`run_memory` result."""
    c = res["config"]
    head = (f"kvchat bench memory: {res['model']}, {c['num_layers']} layers x {c['num_kv_heads']} KV heads x "
            f"{c['head_dim']} head_dim, blocks of {c['block_size']} tokens; measured from allocated pool tensors")
    rows = [("kv dtype", "bytes/token", "K+V", "scales", "formula", "vs fp16")]
    for p in res["pools"]:
        rows.append((p["kv_dtype"], f"{p['bytes_per_token']:,.0f}", f"{p['kv_bytes_per_token']:,.0f}",
                     f"{p['scale_bytes_per_token']:,.0f}", f"{p['formula_bytes_per_token']:,}", f"{p['vs_fp16']:.3f}"))
    fit = [("budget GiB", "kv dtype", "blocks", "chats (BlockManager)", "chats (arithmetic)")]
    for f in res["chats_that_fit"]:
        fit.append((f"{f['budget_bytes'] / GIB:g}", f["kv_dtype"], f"{f['blocks']:,}",
                    f"{f['chats_block_manager']:,} x {f['chat_tokens']}", f"{f['chats_arithmetic']:,}"))
    w = res["paged_waste"]
    waste = (f"paged waste over {w['chats']} chats ({w['mix']}): {w['tokens_in_use']:,} tokens in use, "
             f"{w['allocated_slots']:,} slots allocated, {w['filled_slots']:,} filled -> internal waste "
             f"{w['internal_waste_slots']:,} slots ({w['internal_waste_pct']:.2f}% of allocated); "
             f"prefix sharing saved {w['shared_saved_slots']:,} slots; one contiguous max-context "
             f"({w['max_context']}) buffer per chat would waste {w['contiguous_waste_pct']:.1f}%")
    return "\n\n".join([head, format_table(rows), format_table(fit), waste])


def cmd_bench_memory(args: argparse.Namespace) -> int:
    """``kvchat bench memory``: print the tables; write JSON to ``args.json`` if set. Returns 0."""
    res = run_memory(args)
    return print_report(res, format_report(res), args.json)
