"""Free disk space, checked before a turn is generated: a full disk is said before the work, not after it.

A turn writes its KV snapshot (chunk files: :attr:`kvchat.engine.kv_pool.KVCacheSpec.bytes_per_token`
per token, as in the pool) and a few index rows (SQLite, its WAL, the search
index) into the data dir.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from kvchat.units import size_text

INDEX_SLACK_BYTES = 4 * 2**20  # SQLite rows, WAL frames and FTS entries of one turn, with room to spare


class NoSpaceError(OSError):
    """The data dir's disk has less free space than the turn would write."""


def turn_bytes(bytes_per_token: int, tokens: int) -> int:
    """Bytes a turn of ``tokens`` new tokens (message + longest answer) writes at most, snapshot and index."""
    return bytes_per_token * tokens + INDEX_SLACK_BYTES


def check_turn_space(data_dir: Path, session, user_tokens: int, max_tokens: int) -> None:
    """Raise before generating if the data dir's disk cannot take the turn's snapshot and rows.

    ``session`` is a :class:`kvchat.engine.session.Session`; the answer is at most
    ``max_tokens`` and what the context has left; a save rewrites the open
    chunk, so up to one chunk (:data:`kvchat.engine.persistence.CHUNK_TOKENS`) of
    earlier tokens is written again.

    Raises:
        NoSpaceError: see :func:`check_free_space`.
    """
    from kvchat.engine.persistence import CHUNK_TOKENS

    answer = max(0, min(max_tokens, session.tokens_left - user_tokens))
    check_free_space(data_dir, turn_bytes(session.engine.spec.bytes_per_token, user_tokens + answer + CHUNK_TOKENS))


def check_free_space(data_dir: Path, needed: int) -> None:
    """Raise if the disk holding ``data_dir`` has fewer than ``needed`` bytes free.

    Raises:
        NoSpaceError: one line with the free and needed sizes (MB) and what to do.
    """
    free = shutil.disk_usage(data_dir).free
    if free < needed:
        raise NoSpaceError(f"not enough free space for this turn in {data_dir}: {size_text(free)} free, it needs "
                           f"about {size_text(needed)} (its KV snapshot and index rows); free some space or run "
                           "'kvchat cache purge', then try again")
