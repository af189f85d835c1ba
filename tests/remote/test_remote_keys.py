"""A server's address, its API key (an environment variable or the 0600 keys file, never the command line),
the plain-http warning and ``KVCHAT_SERVER``."""

from __future__ import annotations

import pytest

from kvchat import settings
from kvchat.cli.main import main
from kvchat.remote.keys import KEYS_FILE, api_key
from kvchat.server_address import base_url, plain_http_warning, server_fingerprint, server_of

SERVER = "https://gpu-box.example:8000"


@pytest.mark.parametrize("given", ["https://gpu-box.example:8000", "https://gpu-box.example:8000/",
                                   "https://gpu-box.example:8000/v1", " https://gpu-box.example:8000/v1/ "])
def test_a_server_is_recorded_without_v1_or_slash(given):
    assert base_url(given) == SERVER
    assert server_of(server_fingerprint(SERVER)) == SERVER and server_of("8c1f6d79") is None


@pytest.mark.parametrize("bad", ["gpu-box:8000", "ftp://gpu-box", "http://", ""])
def test_a_server_that_is_not_an_http_url_is_refused(bad):
    with pytest.raises(ValueError, match="http:// or https:// URL with a host"):
        base_url(bad)


def test_plain_http_warns_for_another_host_only():
    for quiet in ("http://127.0.0.1:8000", "http://localhost:8000", "http://[::1]:8000", "https://10.0.0.5"):
        assert plain_http_warning(quiet) is None, quiet
    warning = plain_http_warning("http://10.0.0.5:8000")
    assert "unencrypted" in warning and "10.0.0.5" in warning


def test_the_key_comes_from_the_variable_named(monkeypatch):
    monkeypatch.setenv("MY_KEY", " sk-123 ")
    assert api_key(SERVER, "MY_KEY") == "sk-123"
    monkeypatch.delenv("MY_KEY")
    with pytest.raises(ValueError, match="--api-key-env names MY_KEY, which is not set"):
        api_key(SERVER, "MY_KEY")


def test_the_keys_file_gives_each_server_its_own_key_and_must_be_private(kvchat_home):
    assert api_key(SERVER, None) is None  # no file: no key
    path = kvchat_home / KEYS_FILE
    path.write_text(f'"{SERVER}" = "sk-box"\n"https://other:1" = "sk-other"\n')
    path.chmod(0o600)
    assert api_key(SERVER, None) == "sk-box" and api_key("https://third:2", None) is None
    path.chmod(0o644)
    with pytest.raises(ValueError, match=f"others may read it .mode 644.; run: chmod 600 {path}"):
        api_key(SERVER, None)
    path.chmod(0o600)
    path.write_text("not toml [")
    with pytest.raises(ValueError, match="is not valid TOML"):
        api_key(SERVER, None)


def test_a_key_typed_on_the_command_line_is_refused_and_not_repeated(capsys):
    # no abbreviated options: --api-key is an unknown option, named without the value after it
    with pytest.raises(SystemExit) as exit_:
        main(["ask", "--server", SERVER, "--api-key", "sk-123", "hello"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "unrecognized arguments: --api-key" in err and "sk-123" not in err


def test_api_key_env_without_a_server_is_one_line(capsys, monkeypatch):
    monkeypatch.delenv("KVCHAT_SERVER", raising=False)
    assert main(["ask", "--api-key-env", "MY_KEY", "hello"]) == 2
    assert capsys.readouterr().err.strip() == ("kvchat: error: --api-key-env names the key of a server: give "
                                               "--server URL (or set KVCHAT_SERVER)")


def test_kvchat_server_setting(monkeypatch):
    monkeypatch.setenv("KVCHAT_SERVER", "https://gpu-box.example:8000/v1")
    assert settings.server() == SERVER
    monkeypatch.setenv("KVCHAT_SERVER", "gpu-box")
    with pytest.raises(settings.SettingError, match="KVCHAT_SERVER must be an http:// or https:// URL"):
        settings.check()
    monkeypatch.setenv("KVCHAT_SERVER", "")
    assert settings.server() is None
    monkeypatch.setenv("KVCHAT_SERVER_TIMEOUT_S", "0")
    with pytest.raises(settings.SettingError, match="KVCHAT_SERVER_TIMEOUT_S must be a positive number of seconds"):
        settings.server_timeout_s()
