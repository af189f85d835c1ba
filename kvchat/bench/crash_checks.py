"""What must hold in a data dir after any ``kill -9`` of ``kvchat ask`` (the kill loop's checks).

- ``PRAGMA integrity_check`` answers ``ok``.
- Every chunk file with an index row passes its checksum; files without a row
  (an interrupted write: a temp file, or a file renamed just before its row
  insert) and rows without a file (an interrupted delete) are counted, since
  ``kvchat cache gc``/``verify`` and restores repair them.
- Every conversation holds exactly the scripted turns it completed (the killed
  turn too when the kill came after its commit): each user message is the
  script's question, each answer the reference answer, and the token ids
  equal the reference's after that many turns.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

from kvchat.bench.crash_script import QUESTIONS, Reference


@dataclass(slots=True)
class StoreCheck:
    """Outcome of :func:`check_store`.

    Attributes:
        integrity: the first row of ``PRAGMA integrity_check`` ("ok" when sound).
        chunks: index rows checked.
        corrupt: rows whose existing file fails verification (must be 0).
        files_without_row: files under ``kv/`` that no row names (temp or renamed-not-indexed).
        rows_without_file: rows whose file is missing (restores and ``cache verify`` drop them).
        turns: stored completed turns per conversation id.
        problems: every violated requirement, one line each; empty when all hold.
    """

    integrity: str = ""
    chunks: int = 0
    corrupt: int = 0
    files_without_row: int = 0
    rows_without_file: int = 0
    turns: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def integrity(db_file: Path) -> str:
    """First row of ``PRAGMA integrity_check`` on ``db_file`` (``"ok"`` when the database is sound)."""
    conn = sqlite3.connect(db_file, timeout=30)
    try:
        return conn.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        conn.close()


def _check_chunks(home: Path, db, out: StoreCheck) -> None:
    from kvchat.store.chunk_index import list_chunks
    from kvchat.store.errors import CorruptChunkError
    from kvchat.store.snapshot_read import verify_chunk_file

    rows = list_chunks(db)
    kv = home / "kv"
    named = {r.file_path for r in rows}
    out.chunks = len(rows)
    for r in rows:
        path = kv / r.file_path
        if not path.exists():
            out.rows_without_file += 1
            continue
        try:
            verify_chunk_file(path, key=r.key, fingerprint=r.fingerprint, checksum=r.checksum)
        except CorruptChunkError as exc:
            out.corrupt += 1
            out.problems.append(f"chunk {r.key[:12]} is indexed but fails verification: {exc}")
    if kv.is_dir():
        out.files_without_row = sum(1 for p in kv.glob("*/*") if p.is_file() and p.relative_to(kv).as_posix() not in named)


def _check_conversation(conv, ref: Reference, out: StoreCheck) -> None:
    msgs = conv.messages
    n = len(msgs) // 2
    out.turns[conv.id] = n
    if len(msgs) % 2 or n == 0 or n > len(ref.answers):
        out.problems.append(f"{conv.id}: {len(msgs)} messages is not 1..{len(ref.answers)} whole turns")
        return
    for i in range(n):
        user, answer = msgs[2 * i], msgs[2 * i + 1]
        if (user.role, user.text) != ("user", QUESTIONS[i]):
            out.problems.append(f"{conv.id} turn {i + 1}: user message {user.text!r} is not the script's")
        if (answer.role, answer.text) != ("assistant", ref.answers[i]):
            out.problems.append(f"{conv.id} turn {i + 1}: stored answer {answer.text!r} != reference {ref.answers[i]!r}")
    if conv.token_ids != ref.token_ids[n - 1]:
        out.problems.append(f"{conv.id}: token ids after {n} turns differ from the reference's")


def check_store(home: Path, ref: Reference) -> StoreCheck:
    """Run every check on the data dir ``home`` (no kvchat process may be running on it).

    Raises:
        sqlite3.DatabaseError: the database cannot be opened at all (reported by the caller as a failure).
    """
    from kvchat.store.conversations import get_conversation
    from kvchat.store.db import connect

    out = StoreCheck()
    db_file = home / "kvchat.db"
    if not db_file.exists():  # killed before the first commit ever: nothing stored yet
        out.integrity = "ok"
        return out
    out.integrity = integrity(db_file)
    if out.integrity != "ok":
        out.problems.append(f"PRAGMA integrity_check: {out.integrity}")
    db = connect(db_file)
    try:
        _check_chunks(home, db, out)
        for row in db.query("SELECT id FROM conversations ORDER BY created"):
            _check_conversation(get_conversation(db, row["id"]), ref, out)
    finally:
        db.close()
    return out
