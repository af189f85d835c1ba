"""Where kvchat keeps things on disk.

Two roots, each with its own override, so that tests can give every case a
fresh data dir while sharing one imported model:

- data dir (conversations, SQLite index, KV snapshots): ``$KVCHAT_HOME`` or
  platformdirs' user data dir for "kvchat".
- models dir (imported models): ``$KVCHAT_MODELS`` or platformdirs' user
  cache dir for "kvchat" + ``/models``.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP_NAME = "kvchat"


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
    env = os.environ.get("KVCHAT_HOME")
    return _ensure(Path(env) if env else Path(platformdirs.user_data_dir(APP_NAME)))


def models_dir() -> Path:
    """Directory for imported models (independent of :func:`data_dir`)."""
    env = os.environ.get("KVCHAT_MODELS")
    return _ensure(Path(env) if env else Path(platformdirs.user_cache_dir(APP_NAME)) / "models")


def db_path() -> Path:
    """Path of the SQLite index inside the data dir."""
    return data_dir() / "kvchat.db"
