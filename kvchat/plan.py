"""The arithmetic of ``kvchat plan``: how many chats of a given length fit on a GPU, per KV dtype.

The arithmetic of the 40 GB example in the article :data:`ARTICLE` (a 7B
model in fp16 on an A100 40 GB holds 12 concurrent 4096-token chats):

- KV bytes per token = 2 (K and V) × layers × KV heads × (head_dim × bytes
  per value + scale bytes), with kvchat's fp8 pools storing one fp32 scale
  per token and KV head (:attr:`kvchat.engine.kv_pool.KVCacheSpec.bytes_per_token`);
- a chat takes its context rounded up to whole blocks of ``BLOCK_SIZE`` tokens;
- GPU memory is advertised in decimal GB (40 GB = 37.25 GiB); weights take
  parameters × bytes per weight; chats that fit = floor((GPU − weights −
  reserve) / bytes per chat). Like the article, activations are ignored
  unless ``--reserve-gb`` sets memory aside for them.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from kvchat.engine.cache_identity import BLOCK_SIZE
from kvchat.model.config import ModelConfig

ARTICLE = '"KV Cache Optimization: Efficient Context Storage"'
GIB = 2**30
WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
PLAN_KV_DTYPES = ("fp16", "bf16", "fp8")
DEFAULT_CONTEXT = 4096  # tokens per chat planned when none is given (the model's own limit when shorter)


class PlanInputError(ValueError):
    """Plan inputs that make no sense (non-positive context or GPU size, missing config)."""


@dataclass(slots=True, frozen=True)
class KVRow:
    """One KV dtype's line of a plan: bytes per token and per chat, chats that fit."""

    kv_dtype: str
    bytes_per_token: int
    bytes_per_chat: int
    chats: int


@dataclass(slots=True, frozen=True)
class MemoryPlan:
    """Weights plus KV arithmetic for one model, context and GPU size (bytes unless named)."""

    model: str
    params: int
    weight_bytes: int
    gpu_bytes: int
    reserve_bytes: int
    context: int
    rows: tuple[KVRow, ...]
    device: str = "GPU"  # what gpu_bytes is the memory of (:func:`this_machine`'s name when it was not given)

    @property
    def kv_budget_bytes(self) -> int:
        """Bytes left for the KV cache (negative: the weights alone do not fit)."""
        return self.gpu_bytes - self.weight_bytes - self.reserve_bytes


@dataclass(slots=True, frozen=True)
class Machine:
    """The device kvchat runs on here: ``name`` (e.g. ``cuda:0 NVIDIA H200`` or ``cpu``) and its memory in
    decimal GB."""

    name: str
    memory_gb: float


def this_machine() -> Machine:
    """The current CUDA GPU and its total memory (``torch.cuda.get_device_properties``) where torch sees one,
    else the CPU and the machine's physical RAM (``sysconf``: pages x page size)."""
    import torch

    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return Machine(f"cuda:{index} {props.name}", props.total_memory / 1e9)
    return Machine("cpu", os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 1e9)


def count_params(cfg: ModelConfig) -> int:
    """Parameters of a Llama-family decoder from its config.

    Embeddings (+ an untied LM head), per layer q/k/v/o projections (+ Qwen2
    q/k/v bias, + Qwen3 q/k norms), SwiGLU gate/up/down, two RMSNorms, and the
    final norm. Llama-2-7B's config gives 6,738,415,616, its published count.
    """
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    attn = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size
    attn += (q + 2 * kv) if cfg.attention_bias else 0
    attn += 2 * cfg.head_dim if cfg.qk_norm else 0
    layer = attn + 3 * cfg.hidden_size * cfg.intermediate_size + 2 * cfg.hidden_size
    embed = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    return embed + cfg.num_layers * layer + cfg.hidden_size


def plan_memory(
    cfg: ModelConfig,
    *,
    context: int,
    gpu_gb: float,
    params: float | None = None,
    weight_dtype: str = "bf16",
    reserve_gb: float = 0.0,
    model: str = "",
    kv_dtypes: tuple[str, ...] = PLAN_KV_DTYPES,
    device: str = "GPU",
) -> MemoryPlan:
    """Chats of ``context`` tokens that fit beside the weights on a ``gpu_gb`` GPU.

    Args:
        cfg: the model's config.
        context: tokens per chat (rounded up to whole blocks of ``BLOCK_SIZE``), at most the model's
            ``max_position_embeddings``.
        gpu_gb: GPU memory in decimal GB, as advertised (40 -> 40e9 bytes).
        params: parameter count, rounded down (None: :func:`count_params`).
        weight_dtype: ``fp32|bf16|fp16``, bytes per weight.
        reserve_gb: decimal GB set aside for activations and runtime.
        device: what ``gpu_gb`` is the memory of, as the plan names it.
    Raises:
        PlanInputError: a non-positive context or GPU size, params under 1, a context beyond the model's, a
            negative reserve, inf or nan sizes (each names its flag), an unknown weight dtype.
    """
    for flag, value, ok, rule in (("--gpu-gb", gpu_gb, gpu_gb > 0, "a positive number"),
                                  ("--reserve-gb", reserve_gb, reserve_gb >= 0, "a number not below 0"),
                                  ("--params", params, params is None or params >= 1, "a count of at least 1"),
                                  ("--context", context, context >= 1, "a positive number of tokens")):
        if value is not None and not ((isinstance(value, int) or math.isfinite(value)) and ok):  # ints: no inf
            raise PlanInputError(f"{flag} must be {rule}, not {value:g}")
    if context > cfg.max_position_embeddings:  # a context of any size, 400 digits too, is compared as an int
        raise PlanInputError(f"--context {context} is beyond {model or 'the model'}'s context of "
                             f"{cfg.max_position_embeddings} tokens; its chats cannot be that long")
    if weight_dtype not in WEIGHT_BYTES:
        raise PlanInputError(f"unknown weight dtype {weight_dtype!r} (choose {', '.join(WEIGHT_BYTES)})")
    params = count_params(cfg) if params is None else int(params)
    weight_bytes = params * WEIGHT_BYTES[weight_dtype]
    gpu_bytes, reserve_bytes = round(gpu_gb * 1e9), round(reserve_gb * 1e9)
    budget = gpu_bytes - weight_bytes - reserve_bytes
    from kvchat.engine.kv_pool import KVCacheSpec  # imports torch: not at module level, where the CLI's parser reads

    tokens = math.ceil(context / BLOCK_SIZE) * BLOCK_SIZE
    rows = []
    for kv in kv_dtypes:
        per_token = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv).bytes_per_token
        per_chat = per_token * tokens
        rows.append(KVRow(kv, per_token, per_chat, max(0, budget // per_chat)))
    return MemoryPlan(model, params, weight_bytes, gpu_bytes, reserve_bytes, context, tuple(rows), device)


def load_plan_config(spec: str | None) -> tuple[str, ModelConfig, int | None]:
    """``(name, config, parameters counted from the weights or None)`` for ``--model``.

    A ``config.json`` file or a directory holding one is read directly (no
    weights needed, nothing is hashed); other values go through
    :func:`kvchat.model.registry.resolve_model` (imported names, ``.gguf``).

    Raises:
        kvchat.model.registry.ModelNotFoundError, kvchat.model.config.UnsupportedModelError,
        PlanInputError: a config file that is not JSON.
    """
    from kvchat.model.fingerprint import tensor_entries
    from kvchat.model.registry import resolve_model

    path = Path(spec).expanduser() if spec else None
    if path is not None and (path.suffix == ".json" and path.is_file() or (path / "config.json").is_file()):
        config_file = path if path.is_file() else path / "config.json"
        try:
            hf = json.loads(config_file.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise PlanInputError(f"{config_file}: not a JSON model config ({exc})") from None
        cfg = ModelConfig.from_hf(hf)
        model_dir = config_file.parent.resolve()  # named after its folder, also for a bare "config.json"
        has_weights = any(model_dir.glob("*.safetensors"))
        params = sum(math.prod(e.shape) for e in tensor_entries(model_dir)) if has_weights else None
        return model_dir.name, cfg, params
    info = resolve_model(spec)
    return info.name, info.config, sum(math.prod(e.shape) for e in tensor_entries(info.path))
