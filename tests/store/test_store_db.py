"""SQLite index: migrations from every schema version, backups, failure and crash safety, connection settings."""

from __future__ import annotations

import os
import sqlite3
import stat
import subprocess
import sys
import threading

import pytest
from sqlite_utils import Database
from sqlite_utils.migrations import Migrations

from kvchat.index import get_db
from kvchat.paths import db_path
from kvchat.store import migrations as mig
from kvchat.store.db import close_thread_dbs, connect, write_transaction
from kvchat.store.errors import MigrationError, SchemaTooNewError, TruncatedDatabaseError

COLUMNS = {
    "models": {"fingerprint", "name", "source", "config", "created"},
    "conversations": {"id", "title", "model_fingerprint", "model_name", "system_prompt", "settings", "created",
                      "updated", "pinned", "token_ids", "token_ids_version", "segments"},
    "messages": {"id", "conversation_id", "idx", "role", "text", "token_start", "token_end", "ttft_ms",
                 "decode_tokens_per_s", "created", "finish_reason", "document_tokens"},
    "documents": {"id", "path", "content_hash", "title", "token_count", "created", "pinned"},
    "chunk_refs": {"owner", "key"},
    "kv_chunks": {"key", "parent_key", "fingerprint", "token_count", "file_path", "bytes", "checksum", "created",
                  "last_used", "pinned", "ref_count"},
}
NAMES = mig.schema_names()


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))
    yield tmp_path / "home"
    close_thread_dbs()


def db_at_version(path, n: int) -> Database:
    """A database with only the first ``n`` migrations applied, plus one row per table that exists then."""
    db = Database(path)
    if n < len(NAMES):
        mig.MIGRATIONS.apply(db, stop_before=NAMES[n])
    else:
        mig.MIGRATIONS.apply(db)
    if n >= 1:
        db["conversations"].insert({"id": "c_000001", "title": "old chat", "created": 1.0, "updated": 2.0,
                                    "token_ids": b"\x01\x00\x00\x00"})
        db["messages"].insert({"conversation_id": "c_000001", "idx": 0, "role": "user", "text": "hello there",
                               "token_start": 0, "token_end": 1, "created": 1.0})
    if n >= 2:
        db["kv_chunks"].insert({"key": "ab" * 16, "fingerprint": "fp", "token_count": 1, "file_path": "x",
                                "bytes": 10, "checksum": "c", "created": 1.0, "last_used": 1.0})
    db.close()
    return db


def test_empty_db_gets_every_table_and_column(tmp_path):
    db = connect(tmp_path / "a.db")
    for table, cols in COLUMNS.items():
        assert set(db[table].columns_dict) == cols, table
    assert {t for t in db.table_names() if t.endswith("_fts")} == {"conversations_fts", "messages_fts"}
    assert [m.name for m in mig.MIGRATIONS.applied(db)] == NAMES
    assert not (tmp_path / "backups").exists()  # nothing to back up in an empty database


@pytest.mark.parametrize("version", range(1, len(NAMES)))
def test_every_earlier_version_migrates_without_loss(tmp_path, version):
    path = tmp_path / "old.db"
    db_at_version(path, version)
    db = connect(path)
    for table, cols in COLUMNS.items():
        assert set(db[table].columns_dict) == cols
    assert db["messages"].get(1)["text"] == "hello there"
    assert db["messages"].get(1)["finish_reason"] is None  # not recorded then: no marker
    assert db["messages"].get(1)["document_tokens"] is None  # not recorded then: found again from the text
    assert db["conversations"].get("c_000001")["title"] == "old chat"
    assert db.execute("SELECT rowid FROM messages_fts WHERE messages_fts MATCH 'hello'").fetchall() == [(1,)]
    assert (db["kv_chunks"].count == 1) == (version >= 2)
    backups = list((tmp_path / "backups").iterdir())
    assert len(backups) == 1 and backups[0].name.endswith(f"-before-{NAMES[version]}.db")
    assert stat.S_IMODE(backups[0].stat().st_mode) == 0o600
    old = Database(backups[0])
    assert [m.name for m in mig.MIGRATIONS.applied(old)] == NAMES[:version]
    assert old["messages"].get(1)["text"] == "hello there"


@pytest.mark.fault
def test_failed_migration_leaves_db_untouched(tmp_path, monkeypatch):
    path = tmp_path / "v1.db"
    db_at_version(path, 1)
    broken = Migrations("kvchat")
    for name in NAMES:
        broken(name=name)(getattr(mig, name))

    @broken(name="m999_broken")
    def m999_broken(db):
        db["half_done"].create({"x": int})
        raise RuntimeError("boom")

    monkeypatch.setattr(mig, "MIGRATIONS", broken)
    with pytest.raises(MigrationError, match=r"RuntimeError: boom.*database unchanged, backup at .*backups"):
        connect(path)
    db = Database(path)
    assert [m.name for m in mig.MIGRATIONS.applied(db)] == NAMES[:1]
    assert "half_done" not in db.table_names() and "kv_chunks" not in db.table_names()
    assert db["messages"].get(1)["text"] == "hello there"
    assert len(list((tmp_path / "backups").iterdir())) == 1


@pytest.mark.fault
def test_crash_mid_migration_keeps_old_schema(tmp_path):
    path = tmp_path / "v1.db"
    db_at_version(path, 1)
    code = f"from kvchat.store.db import connect; connect({str(path)!r})"
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "KVCHAT_CRASH_AT": "migration"})
    assert proc.returncode == -9
    db = Database(path)
    assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    assert [m.name for m in mig.MIGRATIONS.applied(db)] == NAMES[:1]
    db.close()
    assert [m.name for m in mig.MIGRATIONS.applied(connect(path))] == NAMES
    assert Database(path)["messages"].get(1)["text"] == "hello there"


def test_newer_schema_refused(tmp_path):
    path = tmp_path / "new.db"
    connect(path).close()
    Database(path)["_sqlite_migrations"].insert({"migration_set": "kvchat", "name": "m999_future", "applied_at": "x"})
    with pytest.raises(SchemaTooNewError, match="m999_future"):
        connect(path)


def test_connection_settings_and_permissions():
    db = get_db()
    assert db_path().exists() and stat.S_IMODE(db_path().stat().st_mode) == 0o600
    assert db.journal_mode == "wal"
    assert db.execute("PRAGMA busy_timeout").fetchone()[0] == 10_000
    assert db.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    assert db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    assert get_db() is db
    other = []
    t = threading.Thread(target=lambda: (other.append(get_db()), close_thread_dbs()))
    t.start()
    t.join()
    assert other[0] is not db


def test_write_transaction_is_immediate_and_rolls_back(tmp_path):
    path = tmp_path / "t.db"
    a = connect(path)
    b = Database(sqlite3.connect(path, timeout=0, isolation_level=None))
    with pytest.raises(RuntimeError):
        with write_transaction(a):
            a["models"].insert({"fingerprint": "f", "name": "m", "created": 1.0})
            with pytest.raises(sqlite3.OperationalError, match="locked"):
                b.execute("BEGIN IMMEDIATE")  # the write lock is already held
            raise RuntimeError("abort")
    assert a["models"].count == 0 and not a.conn.in_transaction
    with write_transaction(a):
        with write_transaction(a):  # nested: a savepoint
            a["models"].insert({"fingerprint": "f", "name": "m", "created": 1.0})
    assert b["models"].count == 1


def test_an_empty_file_is_a_new_database_unless_chunks_exist(tmp_path):
    path = tmp_path / "kvchat.db"
    path.write_bytes(b"")  # e.g. a crash right after creating the file: nothing else exists yet
    connect(path).close()
    assert "kv_chunks" in Database(sqlite3.connect(path)).table_names()
    other = tmp_path / "other"
    (other / "kv" / "00").mkdir(parents=True)
    (other / "kv" / "00" / ("0" * 32 + ".safetensors")).write_bytes(b"x")
    (other / "kvchat.db").write_bytes(b"")
    with pytest.raises(TruncatedDatabaseError, match="truncated"):
        connect(other / "kvchat.db")
    assert (other / "kvchat.db").stat().st_size == 0

