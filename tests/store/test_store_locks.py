"""SQLite's POSIX locks survive a second connection in one process.

On POSIX, closing *any* descriptor of a file drops *all* of the process's
advisory locks on it (SQLite, "How To Corrupt An SQLite Database File",
§2.2). A WAL connection holds a shared lock on the database file while it is
open; a process without it looks "gone" to others, and the last one to close
deletes the WAL under it. ``test_two_writer_processes`` never saw this: each
of its processes opened exactly one connection, so no descriptor was closed
while a connection of the same process was open.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvchat.index import get_db
from kvchat.paths import db_path
from kvchat.store.conversations import NewMessage, append_turn, create_conversation, get_conversation, list_conversations
from kvchat.store.db import close_thread_dbs

ROUNDS = 12

OTHER = """
import sys
from kvchat.index import get_db
from kvchat.store.conversations import NewMessage, append_turn, create_conversation, list_conversations
db = get_db()
seen = {c.title for c in list_conversations(db)}
missing = [t for t in sys.argv[1:] if t not in seen]
if missing:
    sys.exit(f"the other process's chats are not visible here: {missing}")
c = create_conversation(db, title="child-" + str(len(sys.argv)))
append_turn(db, c.id, [1, 2, 3], [NewMessage("user", "from the child", 0, 3)])
print(c.title)
"""


def _posix_locks_on(path: Path) -> list[str]:
    """Lines of /proc/locks that this process holds on ``path`` (matched by device and inode)."""
    st = path.stat()
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pid = str(os.getpid())
    return [ln for ln in Path("/proc/locks").read_text().splitlines()
            if "POSIX" in ln and ln.split()[4] == pid and ln.split()[5] == dev]


def _in_thread(fn):
    """Run ``fn`` in a fresh thread (so it opens its own connection) and return its result."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            out["error"] = exc
        finally:
            close_thread_dbs()

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="needs Linux /proc/locks")
def test_a_second_threads_connection_keeps_the_first_ones_lock():
    db = get_db()
    list_conversations(db)
    before = _posix_locks_on(db_path())
    assert before, "an open WAL connection holds a shared lock on the database file"
    _in_thread(lambda: list_conversations(get_db()))  # a new connect() in another thread
    assert _posix_locks_on(db_path()), "the first connection's lock was dropped by the second connect()"


def test_per_thread_connections_and_short_lived_processes_interleaved():
    """The TUI's shape: a long-lived process whose threads each open a connection, while CLI
    processes write and exit. Every round, each side must see the other's writes."""
    db = get_db()
    mine: list[str] = []
    children: list[str] = []
    for r in range(ROUNDS):
        conv = create_conversation(db, title=f"main-{r}")
        append_turn(db, conv.id, [r], [NewMessage("user", f"main {r}", 0, 1)])
        mine.append(conv.title)
        # a new thread's connection, as the TUI's worker threads open them
        titles = _in_thread(lambda: {c.title for c in list_conversations(get_db())})
        assert set(mine) | set(children) <= titles
        run = subprocess.run([sys.executable, "-c", OTHER, *mine, *children], capture_output=True, text=True,
                             timeout=120, env=os.environ)
        assert run.returncode == 0, run.stderr
        children.append(run.stdout.strip())
        seen = {c.title for c in list_conversations(db)}
        assert set(children) <= seen, f"round {r}: the child's chat is missing from the long-lived connection"
    assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    close_thread_dbs()
    db = get_db()
    assert {c.title for c in list_conversations(db)} == set(mine) | set(children)
    for c in list_conversations(db):
        assert get_conversation(db, c.id).messages, f"{c.title} lost its message"
