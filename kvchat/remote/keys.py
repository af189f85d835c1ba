"""The API key of a server: from the environment variable ``--api-key-env`` names, else from the data dir's
``server-keys.toml``, never from the command line (other users see a process's arguments in
``/proc/PID/cmdline``).

``server-keys.toml`` maps a server (as :func:`kvchat.server_address.base_url` writes it) to its key::

    "https://gpu-box.example:8000" = "sk-…"

It must be readable by its owner alone (mode 0600), as ssh requires of a private key; a key is sent only to
the server it is written for.
"""

from __future__ import annotations

import os
import re
import stat
import tomllib
from pathlib import Path

KEYS_FILE = "server-keys.toml"
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def keys_file() -> Path:
    """The keys file in the data dir (it need not exist)."""
    from kvchat.paths import data_dir

    return data_dir() / KEYS_FILE


def api_key(server: str, env_var: str | None) -> str | None:
    """The key for ``server`` (a :func:`~kvchat.server_address.base_url`): ``env_var``'s value when given,
    else the keys file's entry for it; None when neither has one (a server without a key).

    Raises:
        ValueError: ``env_var`` is not a variable name (a key typed in its place is not repeated in the
            message) or is unset or empty; the keys file is readable by others than its owner, or
            not valid TOML, or its entry for ``server`` is not a string.
    """
    if env_var is not None:
        if not ENV_NAME.fullmatch(env_var):
            raise ValueError("--api-key-env takes the name of an environment variable that holds the key "
                             "(export KVCHAT_SERVER_KEY=…; --api-key-env KVCHAT_SERVER_KEY), never the key itself")
        value = os.environ.get(env_var, "").strip()
        if not value:
            raise ValueError(f"--api-key-env names {env_var}, which is not set (export {env_var}=KEY first)")
        return value
    path = keys_file()
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"{path} holds API keys but others may read it (mode {stat.S_IMODE(mode):o}); "
                         f"run: chmod 600 {path}")
    try:
        keys = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid TOML ({' '.join(str(exc).split())})") from None
    key = keys.get(server)
    if key is not None and not isinstance(key, str):
        raise ValueError(f"{path}: the key for {server!r} must be a string")
    return key.strip() or None if key is not None else None
