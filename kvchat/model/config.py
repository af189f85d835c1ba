"""Model configuration shared by the loader, the runner and the KV cache."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class UnsupportedModelError(ValueError):
    """The checkpoint's ``model_type`` is not one kvchat's runner implements, or its config's sizes are not
    positive integers."""


# the fields every shape computation divides or multiplies by, with their config.json names
_SIZES = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
          "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
          "head_dim": "head_dim", "max_position_embeddings": "max_position_embeddings"}


def _positive(name: str, value: Any) -> int:
    """``value`` when it is a positive integer (a size of the model config's ``name``).

    Raises:
        UnsupportedModelError: it is not.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UnsupportedModelError(f"the model config's {name} must be a positive integer, not {value!r}")
    return value


@dataclass(slots=True, frozen=True)
class ModelConfig:
    """The numbers of a Llama-family decoder that the runner needs.

    Field names follow Hugging Face ``config.json`` semantics; ``head_dim``
    is explicit (Qwen3 and Mistral may set it apart from hidden/heads).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=True)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dict.

        Raises:
            UnsupportedModelError: ``model_type`` is not llama, mistral, qwen2 or qwen3; a size (layers, heads,
                widths, vocabulary, context) is not a positive integer.
        """
        model_type = hf.get("model_type", "<missing>")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model type {model_type!r} is not supported (kvchat runs {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        num_heads = _positive("num_attention_heads", hf["num_attention_heads"])  # divides the hidden size below
        head_dim = hf.get("head_dim") or _positive("hidden_size", hf["hidden_size"]) // num_heads
        rope_scaling = hf.get("rope_scaling") or None
        rope_theta = hf.get("rope_theta")
        rope_params = hf.get("rope_parameters") or {}
        if rope_theta is None:
            rope_theta = rope_params.get("rope_theta", 10000.0)
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = dict(rope_params)
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
            rope_scaling = None
        cfg = cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=hf.get("max_position_embeddings") or 2048,  # absent or null: the usual default
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
            rope_scaling=rope_scaling,
        )
        for attribute, name in _SIZES.items():
            _positive(name, getattr(cfg, attribute))
        return cfg
