"""Search over conversation titles and message text with the store's FTS5 tables (migration m003)."""

from __future__ import annotations

from sqlite_utils import Database


def fts_query(text: str) -> str:
    """A safe FTS5 query: every whitespace-separated word quoted (FTS syntax in the input is literal), as a prefix.

    ``"kv cach"`` becomes ``"kv"* "cach"*`` (all words must match, in any order).
    """
    return " ".join('"' + word.replace('"', '""') + '"*' for word in text.split())


def search_conversation_ids(db: Database, text: str) -> set[str]:
    """Ids of conversations whose title or any message matches every word of ``text`` (empty set for blank text)."""
    query = fts_query(text)
    if not query:
        return set()
    sql = (
        "SELECT c.id FROM conversations c JOIN conversations_fts f ON f.rowid = c.rowid"
        " WHERE conversations_fts MATCH :q"
        " UNION SELECT m.conversation_id FROM messages m JOIN messages_fts f ON f.rowid = m.rowid"
        " WHERE messages_fts MATCH :q"
    )
    return {r["id"] for r in db.query(sql, {"q": query})}
