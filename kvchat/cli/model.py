"""``kvchat model pull|list``: import models and list them (printing only; the work is in the model modules)."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

from kvchat.model.config import UnsupportedModelError
from kvchat.model.fingerprint import WeightFileError, tensor_entries
from kvchat.model.importer import DEFAULT_MODEL_NAME, ModelImportError, pull_model, read_manifest
from kvchat.model.registry import list_models


def cmd_model_pull(from_path: str | None, name: str | None) -> int:
    """``kvchat model pull [--from PATH] [--name NAME]``: :func:`kvchat.model.importer.pull_model`, then the
    model's fp8 calibration (:func:`kvchat.runtime.ensure_calibration`), so its first chat does not wait for it.

    Returns 0, or 2 after one ``kvchat: error: …`` line on stderr.
    """
    try:
        target = pull_model(Path(from_path) if from_path is not None else None, name)
    except (ModelImportError, UnsupportedModelError) as e:
        print(f"kvchat: error: {e}", file=sys.stderr)
        return 2
    _calibrate(target)
    manifest = read_manifest(target)
    print(f"{manifest['name']}: {target} (fingerprint {manifest['fingerprint'][:12]})")
    return 0


def _calibrate(model_dir: Path) -> None:
    """Make the fp8 K-centring calibration now (once per model), so the first load stays fast."""
    from transformers import AutoTokenizer

    from kvchat.model.registry import load_weights, resolve_model
    from kvchat.runtime import ensure_calibration

    info = resolve_model(str(model_dir), auto_pull=False)
    ensure_calibration(info, load_weights(info), AutoTokenizer.from_pretrained(str(info.path)))


def weights_origin(source: str) -> str:
    """What an imported model's weights are, from its manifest's ``source``: a GGUF is dequantized at import
    (its quantization type, e.g. Q4_1, read from the file name as GGUF files are named), so the weights carry
    its rounding, not the original checkpoint's; anything else is a checkpoint as given."""
    if not source.lower().endswith(".gguf"):
        return "checkpoint"
    kind = re.search(r"[.-](I?Q\d\w*|BF16|F16|F32)\.gguf$", source, re.IGNORECASE)
    return f"dequantized {kind.group(1).upper() if kind else ''} GGUF".replace("  ", " ")


def cmd_model_list() -> int:
    """``kvchat model list``: print name (the default one marked), parameters, fingerprint prefix, size on disk,
    what the weights are (:func:`weights_origin`) and source. Returns 0."""
    models = list_models()
    if not models:
        print("no models imported yet; run `kvchat model pull`")
        return 0
    rows = [("NAME", "PARAMS", "FINGERPRINT", "SIZE", "WEIGHTS", "SOURCE")]
    for m in models:
        try:  # headers only; a damaged model is listed, with how to repair it
            params = f"{sum(math.prod(e.shape) for e in tensor_entries(m.path)) / 1e6:.1f}M"
        except WeightFileError as exc:
            params = "damaged"
            print(f"kvchat: warning: {exc}; remove {m.path} and run `kvchat model pull` again", file=sys.stderr)
        size = sum(p.stat().st_size for p in m.path.iterdir() if p.is_file())
        name = f"{m.name} (default)" if m.name == DEFAULT_MODEL_NAME else m.name
        rows.append((name, params, m.fingerprint[:12], f"{size / 1e6:.1f} MB", weights_origin(m.source), m.source))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
    return 0
