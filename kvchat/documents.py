"""Reading attached documents safely: size checked before reading, text only."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from pathlib import Path

from kvchat.utf8 import NotUtf8Error, require_utf8

MAX_DOCUMENT_BYTES = 4 * 2**20
BINARY_SNIFF_BYTES = 8192
PASTED_PATH = ""  # the stored path of a document pasted into a message (it names no file)


def doc_id(text: str) -> str:
    """Stable id of a document's content: ``d_`` + 10 hex of blake2b."""
    return "d_" + hashlib.blake2b(text.encode(), digest_size=5).hexdigest()


def prefix_doc_id(token_ids: list[int]) -> str:
    """Stable id of a pasted document by the ids of its whole prefix (``d_`` + 10 hex of blake2b over the ids
    as little-endian uint32, the same on every machine): the same text after another system prompt is another prefix."""
    data = struct.pack(f"<{len(token_ids)}I", *token_ids)
    return "d_" + hashlib.blake2b(data, digest_size=5, person=b"kvchat-pasted").hexdigest()


class DocumentError(ValueError):
    """A document cannot be attached (missing, unreadable, binary, not UTF-8, too large, empty)."""


@dataclass(slots=True, frozen=True)
class Document:
    """An attached document: display title (file name) and its text."""

    title: str
    text: str
    path: Path


def read_document(path: str | Path, max_bytes: int = MAX_DOCUMENT_BYTES) -> Document:
    """Read a UTF-8 text file to attach as a cached prefix.

    The byte size is checked with ``stat`` before anything is read, so a huge
    file is refused without loading it.

    Raises:
        DocumentError: with a one-line reason.
    """
    if not str(path).strip():  # Path("") is ".": say what was given
        raise DocumentError("the document path is empty")
    p = Path(path).expanduser()
    try:
        size = p.stat().st_size
    except OSError as exc:
        raise DocumentError(f"cannot read document {str(p)!r}: {exc.strerror or exc}") from None
    if not p.is_file():
        raise DocumentError(f"document {str(p)!r} is not a regular file")
    if size > max_bytes:
        raise DocumentError(f"document {str(p)!r} is {size:,} bytes; the limit is {max_bytes:,} bytes")
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise DocumentError(f"cannot read document {str(p)!r}: {exc.strerror or exc}") from None
    if b"\0" in raw[:BINARY_SNIFF_BYTES]:
        raise DocumentError(f"document {str(p)!r} looks binary (NUL bytes); attach text files only")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DocumentError(f"document {str(p)!r} is not UTF-8 text (bad byte at offset {exc.start})") from None
    if not text.strip():
        raise DocumentError(f"document {str(p)!r} is empty")
    try:  # the file name is the document's title (tokenized), its path is stored: both must be UTF-8 too
        full = str(p.resolve())
        require_utf8(full, f"the document path {full!r}")
    except NotUtf8Error as exc:
        raise DocumentError(str(exc)) from None
    return Document(p.name, text, p)
