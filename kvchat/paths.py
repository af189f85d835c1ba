"""Where kvchat keeps things on disk.

Two roots, each with its own override, so that tests can give every case a
fresh data dir while sharing one imported model:

- data dir (conversations, SQLite index, KV snapshots): ``$KVCHAT_HOME``
  (:func:`kvchat.settings.home`, which has the default).
- models dir (imported models): ``$KVCHAT_MODELS``
  (:func:`kvchat.settings.models`).
"""

from __future__ import annotations

from pathlib import Path

from kvchat import settings


def _ensure(path: Path) -> Path:
    """Create ``path`` (mode 0700) if missing and return it.

    Raises:
        NotADirectoryError: ``path`` exists and is not a directory (the message names it and the variables).
    """
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{path} is not a directory (check KVCHAT_HOME and KVCHAT_MODELS)")
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def data_dir() -> Path:
    """Directory for conversations, the SQLite index and KV snapshots."""
    return _ensure(settings.home())


def models_dir() -> Path:
    """Directory for imported models (independent of :func:`data_dir`)."""
    return _ensure(settings.models())


def db_path() -> Path:
    """Path of the SQLite index inside the data dir."""
    return data_dir() / "kvchat.db"
