"""K centring for the fp8 pool: a per-layer, per-KV-head mean of post-RoPE K, calibrated once per model.

Softmax is invariant to adding one constant to all scores of a query, so
subtracting a fixed vector ``m`` from every stored K changes each score of
query ``q`` by the same ``q · m`` and leaves attention unchanged, while fp8
(e4m3) keeps a fixed *relative* precision: removing K's large, steady
per-channel offsets (the outlier channels that led KIVI, Liu et al. 2024, to
quantize K per channel) shrinks every element's rounding error. The mean is
taken with a bf16 pool over text the fidelity benchmark never evaluates on
(standard-library docstrings, :data:`kvchat.texts.CALIBRATION_MODULES`),
leaving out position 0 (the attention sink, an outlier the engine keeps exact
anyway).

Computed on first use by :func:`kvchat.runtime.ensure_calibration`, on the
engine being built (its weights, a throw-away 16-bit pool of 1,024 tokens:
:func:`kvchat.engine.scratch.calibrate_k_mean`, freed afterwards), and stored once per model fingerprint as
``models_dir()/.calibration/<fingerprint>.safetensors``;
its digest is part of the cache fingerprint, so a different calibration never
restores K/V stored under another.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from kvchat.paths import models_dir
from kvchat.safetensors_file import save_atomic

CALIBRATION_TOKENS = 1024
CALIBRATION_VERSION = 1
CALIBRATION_DIR = ".calibration"


@dataclass(slots=True, frozen=True)
class KVCalibration:
    """A model's K-centring vector.

    Attributes:
        k_mean: float32 ``[num_layers, num_kv_heads, head_dim]``, subtracted from post-RoPE K before it is stored.
        digest: hex sha256 of the version and ``k_mean``'s bytes (enters the cache fingerprint).
        source: the calibration text's name and token count.
    """

    k_mean: torch.Tensor
    digest: str
    source: str


def calibration_path(model_fingerprint: str) -> Path:
    """Where a model's calibration lives (the models dir, so checkpoints used in place get one too)."""
    return models_dir() / CALIBRATION_DIR / f"{model_fingerprint}.safetensors"


def _digest(k_mean: torch.Tensor) -> str:
    blob = k_mean.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
    return hashlib.sha256(f"kvchat-k-mean-v{CALIBRATION_VERSION}:".encode() + blob).hexdigest()


def make_calibration(k_mean: torch.Tensor, source: str) -> KVCalibration:
    """Wrap a ``k_mean`` ``[num_layers, num_kv_heads, head_dim]`` with its digest (moved to CPU float32)."""
    k_mean = k_mean.detach().to("cpu", torch.float32).contiguous()
    return KVCalibration(k_mean, _digest(k_mean), source)


def load_calibration(model_fingerprint: str, shape: tuple[int, int, int]) -> KVCalibration | None:
    """The stored calibration of a model, or None if absent, unreadable or of another shape/version."""
    from safetensors import SafetensorError, safe_open

    path = calibration_path(model_fingerprint)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            k_mean = f.get_tensor("k_mean")
    except (OSError, SafetensorError):
        return None
    if meta.get("version") != str(CALIBRATION_VERSION) or tuple(k_mean.shape) != shape or not k_mean.isfinite().all():
        return None
    return make_calibration(k_mean, meta.get("source", "?"))


def stored_digest(model_fingerprint: str) -> str | None:
    """The digest recorded in a model's stored calibration file, or None (no file, unreadable)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(calibration_path(model_fingerprint)), framework="pt") as f:
            return (f.metadata() or {}).get("digest")
    except (OSError, SafetensorError):
        return None


def save_calibration(model_fingerprint: str, cal: KVCalibration) -> Path:
    """Write ``cal`` atomically (temp file, fsync, rename); directory 0700, file 0600. Returns the path.

    Raises:
        OSError: the models dir is not writable.
    """
    return save_atomic({"k_mean": cal.k_mean}, calibration_path(model_fingerprint),
                       {"version": str(CALIBRATION_VERSION), "source": cal.source, "digest": cal.digest})

