"""Build a ready engine and chat format from a ``--model`` value."""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from kvchat.chat_format import ChatFormat
from kvchat.engine import Engine
from kvchat.model_registry import ModelInfo, load_weights, resolve_model


@dataclass(slots=True)
class Runtime:
    """A loaded model: its identity, the engine, and a tokenizer for chat formats."""

    info: ModelInfo
    engine: Engine
    tokenizer: object

    def chat_format(self, settings: dict | None = None) -> ChatFormat:
        """A :class:`ChatFormat` with the chat's pinned date and template options (``settings`` as stored)."""
        settings = settings or {}
        extra = _generation_eos_ids(self.info)
        return ChatFormat(
            self.tokenizer,
            date_string=settings.get("date_string"),
            template_kwargs=settings.get("template_kwargs"),
            extra_stop_ids=extra,
        )


def _generation_eos_ids(info: ModelInfo) -> list[int]:
    path = info.path / "generation_config.json"
    if not path.is_file():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    return [eos] if isinstance(eos, int) else list(eos or [])


def load_runtime(
    model: str | None,
    kv_dtype: str = "fp8",
    *,
    device: str | None = None,
    pool_bytes: int | None = None,
) -> Runtime:
    """Resolve (importing on first use), load weights, build the engine and tokenizer.

    Raises:
        kvchat.model_registry.ModelNotFoundError, kvchat.config.UnsupportedModelError,
        kvchat.model_import.ModelImportError, kvchat.kv_cache.KVDtypeError.
    """
    from transformers import AutoTokenizer

    from kvchat.kv_cache import kv_torch_dtype

    kv_torch_dtype(kv_dtype)
    info = resolve_model(model)
    weights = load_weights(info)
    engine = Engine(info.config, weights, info.fingerprint, kv_dtype=kv_dtype, pool_bytes=pool_bytes,
                    device=device, name=info.name)
    del weights
    tokenizer = AutoTokenizer.from_pretrained(str(info.path))
    return Runtime(info, engine, tokenizer)


def set_threads(n: int | None) -> None:
    """Use ``n`` CPU threads for torch (None: torch's default, one per core).

    Raises:
        ValueError: ``n`` < 1.
    """
    if n is not None and n < 1:
        raise ValueError(f"--threads must be >= 1, got {n}")
    if n:
        torch.set_num_threads(n)
