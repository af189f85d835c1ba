"""Model configuration shared by the loader, the runner and the KV cache."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class UnsupportedModelError(ValueError):
    """The checkpoint's ``model_type`` is not one kvchat's runner implements, or its config's sizes are not
    positive integers."""


def _size(hf: dict[str, Any], key: str, default: int | None = None) -> int:
    """The size ``hf[key]`` of a config.json (layers, heads, widths, vocabulary, context): a positive integer;
    ``default`` where the key is absent or null (None: required).

    Raises:
        UnsupportedModelError: it is required and missing, or not a positive integer (a computed default too).
    """
    value = hf.get(key)
    if value is None:
        if default is None:
            raise UnsupportedModelError(f"the model config has no {key}")
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UnsupportedModelError(f"the model config's {key} must be a positive integer, not {value!r}")
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
            UnsupportedModelError: ``hf`` is not a JSON object; ``model_type`` is not llama, mistral, qwen2 or
                qwen3; a size (layers, heads, widths, vocabulary, context) is missing or not a positive integer.
        """
        if not isinstance(hf, dict):
            raise UnsupportedModelError(f"the model config is a JSON {type(hf).__name__}, not an object")
        model_type = hf.get("model_type", "<missing>")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model type {model_type!r} is not supported (kvchat runs {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        num_heads = _size(hf, "num_attention_heads")
        head_dim = _size(hf, "head_dim", _size(hf, "hidden_size") // num_heads)
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
            vocab_size=_size(hf, "vocab_size"),
            hidden_size=_size(hf, "hidden_size"),
            intermediate_size=_size(hf, "intermediate_size"),
            num_layers=_size(hf, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=_size(hf, "num_key_value_heads", num_heads),
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=_size(hf, "max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
            rope_scaling=rope_scaling,
        )
        return cfg
