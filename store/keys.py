"""Content addresses of KV chunks, stable across processes (pure Python, no torch import)."""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence


def chunk_key(cache_fingerprint: str, parent_key: str | None, token_ids: Sequence[int]) -> str:
    """Content address of a chunk: 32 hex chars of BLAKE2b-128 over canonical bytes.

    Bytes hashed: length-prefixed UTF-8 fingerprint; ``\\x00`` for no parent or
    ``\\x01`` + length-prefixed parent key; token count + ids as little-endian
    uint32. Lengths are 8-byte little-endian. Never uses Python's ``hash()``,
    so keys are identical across processes and restarts.

    Raises:
        ValueError: a token id outside ``[0, 2**32)``.
    """
    try:
        ids = array("I", token_ids)
    except OverflowError as exc:
        raise ValueError("token ids must be in [0, 2**32)") from exc
    if sys.byteorder == "big":
        ids.byteswap()
    h = hashlib.blake2b(digest_size=16, person=b"kvchat-chunk-v1")
    fp = cache_fingerprint.encode()
    h.update(len(fp).to_bytes(8, "little") + fp)
    if parent_key is None:
        h.update(b"\x00")
    else:
        p = parent_key.encode()
        h.update(b"\x01" + len(p).to_bytes(8, "little") + p)
    h.update(len(ids).to_bytes(8, "little"))
    h.update(ids.tobytes())
    return h.hexdigest()
