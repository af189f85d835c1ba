"""A safetensors file's header, parsed once for every reader: the KV snapshot reader and the weight fingerprint.

Format (https://github.com/huggingface/safetensors#format): an 8-byte little-endian header length ``n``, then
``n`` bytes of JSON: an object mapping each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}``
(offsets relative to the data, which starts at ``8 + n``), plus an optional ``"__metadata__"`` object of
strings. Only the length and the header are read, never the data.
"""

from __future__ import annotations

import json
import os
import struct


class HeaderError(ValueError):
    """The header cannot be parsed. ``kind``: ``truncated`` (the file is shorter than it says) or ``header``
    (a bad length or bad JSON); ``detail``: one line."""

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind = kind
        self.detail = detail


def _no_dup_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError("duplicate keys in header JSON")
    return dict(pairs)


def read_header(fd: int, max_bytes: int | None = None) -> tuple[dict, int, int]:
    """Parse the header of the safetensors file open (for reading) as ``fd``.

    Args:
        fd: an open file descriptor; read with ``pread``, its offset is left alone.
        max_bytes: the longest header accepted (bounds what is read before anything is checked); None: the file.
    Returns:
        ``(header, data_start, file_size)``: the JSON object (``__metadata__`` included when present), the
        byte offset where tensor data starts (``8 + n``), and the file's size in bytes.
    Raises:
        HeaderError: shorter than 8 bytes or than its header length (``truncated``); a header length of 0 or
            over ``max_bytes``, JSON that does not parse or repeats a key, or a header that is not an object
            (``header``).
    """
    size = os.fstat(fd).st_size
    if size < 8:
        raise HeaderError("truncated", f"{size} bytes, shorter than the header length")
    (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    if n == 0 or (max_bytes is not None and n > max_bytes):
        raise HeaderError("header", f"header length {n} outside 1..{max_bytes if max_bytes is not None else size - 8}")
    if 8 + n > size:
        raise HeaderError("truncated", f"header of {n} bytes but file has {size}")
    try:
        header = json.loads(os.pread(fd, n, 8), object_pairs_hook=_no_dup_keys)
    except (ValueError, UnicodeDecodeError) as exc:
        raise HeaderError("header", f"bad JSON ({exc})") from None
    if not isinstance(header, dict):
        raise HeaderError("header", "header is not a JSON object")
    return header, 8 + n, size


def read_header_file(path: os.PathLike | str, max_bytes: int | None = None) -> tuple[dict, int, int]:
    """:func:`read_header` of the file at ``path`` (opened for reading and closed again).

    Raises:
        OSError: the file cannot be opened.
        HeaderError: as :func:`read_header`.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return read_header(fd, max_bytes)
    finally:
        os.close(fd)
