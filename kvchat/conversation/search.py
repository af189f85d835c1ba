"""Search over conversation titles and message text with the store's FTS5 tables (migration m003)."""

from __future__ import annotations

from sqlite_utils import Database

from kvchat.store.conversations import search_conversations


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
    return search_conversations(db, query)
