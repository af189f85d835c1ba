"""``kvchat serve``'s API key: ``--api-key`` or ``KVCHAT_API_KEY`` (kept out of the process list); the flag wins."""

import argparse

import pytest

from kvchat.cli.serve import add_serve_args, serve_api_key


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_args(p)
    return p.parse_args(argv)


@pytest.mark.parametrize("argv,env,key", [
    ((), None, None),
    ((), "  env-key \n", "env-key"),
    ((), "", None),
    (("--api-key", "flag-key"), None, "flag-key"),
    (("--api-key", "flag-key"), "env-key", "flag-key"),
], ids=["none", "env", "env-empty", "flag", "flag-wins"])
def test_api_key_from_the_flag_or_the_environment(argv, env, key, monkeypatch):
    if env is None:
        monkeypatch.delenv("KVCHAT_API_KEY", raising=False)
    else:
        monkeypatch.setenv("KVCHAT_API_KEY", env)
    assert serve_api_key(_args(*argv)) == key
