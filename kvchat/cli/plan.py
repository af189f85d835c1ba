"""``kvchat plan``: print the memory plan of :mod:`kvchat.plan` as text or JSON."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from kvchat.model.config import ModelConfig
from kvchat.plan import ARTICLE, DEFAULT_CONTEXT, GIB, MemoryPlan, load_plan_config, plan_memory, this_machine


def format_plan(plan: MemoryPlan, cfg: ModelConfig) -> str:
    """The plan as text: the inputs, the formula with this model's numbers, one row per KV dtype."""
    lines = [
        (f"{plan.model}: {cfg.num_layers} layers, {cfg.num_kv_heads} KV heads x {cfg.head_dim} head_dim; "
         f"{plan.context}-token chats; {plan.device} {plan.gpu_bytes / 1e9:.4g} GB = {plan.gpu_bytes / GIB:.2f} GiB"),
        (f"weights: {plan.params / 1e9:.2f} B params -> {plan.weight_bytes / GIB:.2f} GiB; "
         f"reserved {plan.reserve_bytes / GIB:.2f} GiB; left for KV: {plan.kv_budget_bytes / GIB:.2f} GiB"),
        (f"KV bytes/token = 2 x {cfg.num_layers} layers x {cfg.num_kv_heads} KV heads x "
         f"(head_dim {cfg.head_dim} x bytes/value + 4-byte scale for fp8)"),
        "",
        f"{'kv dtype':<9}{'bytes/token':>12}{'per chat':>12}{'chats':>7}",
    ]
    for r in plan.rows:
        lines.append(f"{r.kv_dtype:<9}{r.bytes_per_token:>12,}{r.bytes_per_chat / GIB:>8.3f} GiB{r.chats:>7}")
    if plan.kv_budget_bytes <= 0:
        lines.append(f"the weights alone do not fit on this {plan.device}")
    if plan.reserve_bytes == 0:
        lines.append(f"activations are not counted (as in the 40 GB example of the article {ARTICLE}); "
                     "set --reserve-gb to hold memory back for them")
    return "\n".join(lines)


def cmd_plan(args: argparse.Namespace) -> int:
    """``kvchat plan``: print (or ``--json``) the memory plan. Returns 0.

    Args (argparse): ``model``, ``context`` (None: :data:`kvchat.plan.DEFAULT_CONTEXT`, or the model's context
    when shorter), ``gpu_gb`` (None: this machine's device and memory,
    :func:`kvchat.plan.this_machine`), ``params``, ``weight_dtype``, ``reserve_gb``, ``json``.
    Raises:
        kvchat.plan.PlanInputError, kvchat.model.registry.ModelNotFoundError, kvchat.model.config.UnsupportedModelError.
    """
    name, cfg, counted = load_plan_config(args.model)
    params = args.params if args.params is not None else counted  # plan_memory checks and rounds it
    machine = this_machine() if args.gpu_gb is None else None
    context = min(DEFAULT_CONTEXT, cfg.max_position_embeddings) if args.context is None else args.context
    plan = plan_memory(cfg, context=context, gpu_gb=machine.memory_gb if machine else args.gpu_gb, params=params,
                       weight_dtype=args.weight_dtype, reserve_gb=args.reserve_gb, model=name,
                       device=machine.name if machine else "GPU")
    if args.json:
        print(json.dumps(asdict(plan) | {"kv_budget_bytes": plan.kv_budget_bytes}))
    else:
        print(format_plan(plan, cfg))
    return 0
