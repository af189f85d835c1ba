"""Model fingerprint: one hex digest naming a model's behaviour, not its files.

The digest is a hash (see "Versions") over length-framed canonical bytes of

1. the weights' content: every tensor, sorted by name, as (name, dtype, shape,
   raw little-endian bytes) — independent of directory, file names and
   sharding; one changed weight changes it;
2. the tokenizer: ``tokenizer.json`` as canonical JSON (or the raw bytes of
   ``tokenizer.model`` / ``vocab.json`` / ``merges.txt`` / ``vocab.txt``) and
   the special-token settings of ``tokenizer_config.json``;
3. the chat template text (``chat_template.jinja``, else
   ``tokenizer_config.json``'s ``chat_template``);
4. the RoPE config (theta and scaling, as :class:`kvchat.model.config.ModelConfig`
   reads them, so ``rope_theta`` and ``rope_parameters`` spellings agree).

Weight bytes are streamed from each safetensors file's data section
(format: 8-byte little-endian header length, JSON header with
``data_offsets``, then the data), so no model is held in RAM by hashing.
Bump :data:`FINGERPRINT_VERSION` whenever the canonical bytes or the hash change.

Versions (:data:`HASHES`): 1 is blake2b-256 (64 hex characters), about
0.5-0.6 GB/s on this machine's cores: 16 GB of 8B weights took ~30 s, slower
than the disk. 2 (new fingerprints) is xxh3-128 (32 hex characters, the
``xxhash`` package), which hashes at memory bandwidth, so a first use is
bound by the disk read. A non-cryptographic hash is enough here: the
fingerprint names the user's own files so that caches of different weights
never mix; nobody gains from forging a collision with their own checkpoint,
and 128 bits make an accidental one negligible (birthday bound ~2**64 models).

Old fingerprints stay valid: the cache fingerprint of every stored KV chunk
is derived from the model fingerprint (:func:`kvchat.engine.cache_identity.cache_fingerprint`),
so recomputing a model's fingerprint with a new hash would orphan every chat
on disk made with it. Hence:

- models kvchat imports (GGUF, wheels: :mod:`kvchat.model.importer`) are
  fingerprinted with version 1 (:data:`IMPORT_FINGERPRINT_VERSION`), now and
  later: a data dir made with the default model resumes after the model is
  imported again on another machine (``tests/test_data_dir_compat.py``: CI
  imports it fresh). The import writes every byte anyway, so blake2b's
  0.5 s per 270 MB is not what a user waits for;
- an imported model keeps the fingerprint its manifest records while its
  ``fingerprint_version`` is one of :data:`HASHES`;
- a Hugging Face checkpoint used in place (the 16 GB first-use case) is
  fingerprinted with version 2 (:data:`FINGERPRINT_VERSION`), and keeps a
  version-1 fingerprint cached before (:func:`cached_fingerprint`) while its
  files are unchanged.

The two versions' digests differ in length, so they can never be equal.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import xxhash
from tqdm import tqdm

from kvchat.model.config import ModelConfig
from kvchat.paths import models_dir
from kvchat.store.atomic_write import write_atomic
from kvchat.store.safetensors_header import HeaderError, read_header_file

FINGERPRINT_VERSION = 2  # checkpoints used in place (see "Versions")
IMPORT_FINGERPRINT_VERSION = 1  # models kvchat imports: stays 1 so data dirs made with them keep resuming
HASHES = {1: lambda: hashlib.blake2b(digest_size=32), 2: lambda: xxhash.xxh3_128()}  # version -> new hasher
_READ_BYTES = 8 << 20
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt")
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token", "add_bos_token", "add_eos_token")
_CACHE_FILE = "fingerprints.json"


class WeightFileError(ValueError):
    """A safetensors file is missing, unreadable or malformed."""


@dataclass(slots=True, frozen=True)
class TensorEntry:
    """Where one tensor's bytes lie: ``file`` at absolute offsets [begin, end)."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files holding a checkpoint's weights, sorted.

    Uses ``model.safetensors.index.json``'s ``weight_map`` when present, else
    every ``*.safetensors`` in ``model_dir``.

    Raises:
        WeightFileError: no safetensors weights in ``model_dir``.
    """
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = set(json.loads(index.read_text())["weight_map"].values())
        files = sorted(model_dir / n for n in names)
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightFileError(f"no *.safetensors weights in {model_dir}")
    return files


def read_tensor_entries(path: Path) -> list[TensorEntry]:
    """Parse one safetensors header into :class:`TensorEntry` rows (file order).

    Raises:
        WeightFileError: the file is not a valid safetensors file, or a tensor's offsets are not two integers
            ``0 <= begin <= end`` inside the file's data (its data would be read from the header or past the end).
    """
    try:
        header, data_start, size = read_header_file(path)
    except (OSError, HeaderError) as e:
        raise WeightFileError(f"{path}: not a readable safetensors file ({e})") from None
    header.pop("__metadata__", None)
    entries = []
    for name, meta in header.items():
        offsets = meta.get("data_offsets") if isinstance(meta, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise WeightFileError(f"{path}: tensor {name!r} has data offsets {offsets!r}, not two ordered byte offsets")
        begin, end = offsets
        if data_start + end > size:
            raise WeightFileError(f"{path}: tensor {name!r} runs past the end of the file (truncated?)")
        entries.append(TensorEntry(name, path, meta["dtype"], tuple(meta["shape"]), data_start + begin, data_start + end))
    return entries


def tensor_entries(model_dir: Path) -> list[TensorEntry]:
    """All tensors of a checkpoint, sorted by name.

    Raises:
        WeightFileError: no weights, a bad file, or one tensor name in two files.
    """
    entries: dict[str, TensorEntry] = {}
    for path in weight_files(model_dir):
        for e in read_tensor_entries(path):
            if e.name in entries:
                raise WeightFileError(f"tensor {e.name!r} appears in both {entries[e.name].file.name} and {path.name}")
            entries[e.name] = e
    return [entries[n] for n in sorted(entries)]


def compute_fingerprint(model_dir: Path, *, progress: bool = True, version: int = FINGERPRINT_VERSION) -> str:
    """Fingerprint a model directory (see module docstring for the bytes hashed).

    Args:
        model_dir: holds ``config.json``, ``*.safetensors`` and tokenizer files.
        progress: show a bytes/s bar on stderr while hashing the weights.
        version: a key of :data:`HASHES` (older ones only to check a stored fingerprint).

    Returns:
        hex digest: 32 characters (version 2, xxh3-128) or 64 (version 1, blake2b-256).

    Raises:
        WeightFileError: missing or malformed weights.
        kvchat.model.config.UnsupportedModelError: ``config.json``'s model type.
    """
    h = HASHES[version]()
    _frame(h, b"kvchat-model-fingerprint", str(version).encode())
    entries = tensor_entries(model_dir)
    total = sum(e.end - e.begin for e in entries)
    handles: dict[Path, BinaryIO] = {}
    buf = memoryview(bytearray(_READ_BYTES))  # one reused buffer: no allocation per read
    try:
        with tqdm(total=total, unit="B", unit_scale=True, desc="fingerprint", file=sys.stderr, disable=not progress) as bar:
            for e in entries:
                f = handles.get(e.file) or handles.setdefault(e.file, open(e.file, "rb", buffering=0))
                _frame(h, b"tensor", _canonical({"name": e.name, "dtype": e.dtype, "shape": list(e.shape)}))
                h.update(struct.pack("<Q", e.end - e.begin))
                f.seek(e.begin)
                left = e.end - e.begin
                while left:
                    n = f.readinto(buf[: min(left, _READ_BYTES)])
                    if not n:
                        raise WeightFileError(f"{e.file}: truncated inside tensor {e.name!r}")
                    h.update(buf[:n])
                    left -= n
                    bar.update(n)
    finally:
        for f in handles.values():
            f.close()
    for name in _TOKENIZER_FILES:
        path = model_dir / name
        if path.is_file():
            data = _canonical(json.loads(path.read_bytes())) if name.endswith(".json") else path.read_bytes()
            _frame(h, f"tokenizer:{name}".encode(), data)
    tok_config = _read_json(model_dir / "tokenizer_config.json")
    _frame(h, b"special-tokens", _canonical({k: tok_config.get(k) for k in _SPECIAL_TOKEN_KEYS}))
    _frame(h, b"chat-template", chat_template_text(model_dir).encode())
    cfg = ModelConfig.from_hf(_read_json(model_dir / "config.json"))
    _frame(h, b"rope", _canonical({"theta": cfg.rope_theta, "scaling": cfg.rope_scaling}))
    return h.hexdigest()


def chat_template_text(model_dir: Path) -> str:
    """The chat template as transformers would load it ("" if none).

    ``chat_template.jinja`` wins over ``tokenizer_config.json``'s
    ``chat_template`` (transformers 5 order); a list of named templates is
    returned as canonical JSON.
    """
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = _read_json(model_dir / "tokenizer_config.json").get("chat_template") or ""
    return template if isinstance(template, str) else _canonical(template).decode()


def cached_fingerprint(model_dir: Path, *, progress: bool = True) -> str:
    """:func:`compute_fingerprint` for a checkpoint used in place, computed once.

    Cached in ``models_dir()/fingerprints.json`` under the directory's
    absolute path, valid while every input file keeps its name, size (bytes)
    and mtime (ns). The key starts with the version that computed it; an entry
    of any version in :data:`HASHES` stays valid (see "Versions" in the module
    doc: caches stored under it keep resuming), a changed file gets a new
    fingerprint of the current version.
    """
    model_dir = model_dir.resolve()
    inputs = [*weight_files(model_dir)] + [
        model_dir / n for n in (*_TOKENIZER_FILES, "tokenizer_config.json", "chat_template.jinja", "config.json")
    ]
    files = [[p.name, st.st_size, st.st_mtime_ns] for p in inputs if p.is_file() for st in [p.stat()]]
    key = [FINGERPRINT_VERSION] + files
    cache_path = models_dir() / _CACHE_FILE
    hit = _read_cache(cache_path).get(str(model_dir))
    if hit and isinstance(hit.get("key"), list) and hit["key"][:1] and hit["key"][0] in HASHES and hit["key"][1:] == files:
        return hit["fingerprint"]
    fingerprint = compute_fingerprint(model_dir, progress=progress)
    cache = _read_cache(cache_path)  # re-read: another process may have added entries meanwhile
    cache[str(model_dir)] = {"key": key, "fingerprint": fingerprint}
    write_atomic(cache_path, lambda tmp: tmp.write_text(json.dumps(cache)), mode=None)
    return fingerprint


def checkpoint_dirs(fingerprint: str) -> list[Path]:
    """The checkpoint directories used in place whose fingerprint :func:`cached_fingerprint` recorded as
    ``fingerprint`` (as recorded: a directory changed since is not hashed again here)."""
    cache = _read_cache(models_dir() / _CACHE_FILE)
    return [Path(d) for d, e in cache.items() if isinstance(e, dict) and e.get("fingerprint") == fingerprint]


def _read_cache(path: Path) -> dict[str, Any]:
    """The fingerprint cache; an unreadable one counts as empty (it is only a cache)."""
    try:
        return _read_json(path)
    except ValueError:
        return {}


def _frame(h, label: bytes, data: bytes) -> None:
    """Feed ``label`` and ``data`` to ``h``, each prefixed by its 8-byte length."""
    for part in (label, data):
        h.update(struct.pack("<Q", len(part)))
        h.update(part)


def _canonical(obj: Any) -> bytes:
    """Canonical JSON bytes: sorted keys, no whitespace, UTF-8."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``, or ``{}`` if the file is absent."""
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
