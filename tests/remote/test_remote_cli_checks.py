"""``--server`` on the command line: a URL holding a user or password, and a local model's options given with a
server, are each one line and exit 2 (``--json``: one error object) before anything is asked or stored."""

from __future__ import annotations

import json
import os

import pytest

from kvchat.cli.main import main
from kvchat.server_address import base_url

URL = "http://127.0.0.1:9"  # nothing is asked of it: every case stops before


def _kvchat_variables() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith("KVCHAT_")}


def one_line(capsys) -> str:
    out = capsys.readouterr()
    [line] = out.err.strip().splitlines()
    assert out.out == "" and line.startswith("kvchat: error: "), out
    return line


@pytest.mark.parametrize("url", ["http://me:s3cret@gpu-box:8000/v1", "https://s3cret@gpu-box", "me:s3cret@gpu-box"])
def test_a_url_with_credentials_is_refused_without_repeating_them(url):
    with pytest.raises(ValueError) as err:
        base_url(url)
    assert "s3cret" not in str(err.value) and "--api-key-env" in str(err.value)


@pytest.mark.parametrize("argv", [["--server", "http://me:s3cret@gpu-box:8000"],
                                  ["ask", "--server", "http://me:s3cret@gpu-box:8000", "hello"]],
                         ids=["tui", "ask"])
def test_credentials_in_server_are_one_line(capsys, kvchat_home, argv):
    assert main(argv) == 2
    line = one_line(capsys)
    assert "user or password" in line and "--api-key-env" in line and "s3cret" not in line, line
    assert not kvchat_home.exists(), "nothing was stored"


def test_credentials_in_kvchat_server_and_json(capsys, monkeypatch, kvchat_home):
    monkeypatch.setenv("KVCHAT_SERVER", "https://me:s3cret@gpu-box/v1")
    assert main(["ask", "--json", "hello"]) == 2
    out = capsys.readouterr()
    err = json.loads(out.out)["error"]
    assert err["type"] == "invalid_request", err
    assert err["exit_status"] == 2 and "KVCHAT_SERVER" in err["message"] and "s3cret" not in out.out + out.err
    assert not kvchat_home.exists()


@pytest.mark.parametrize("argv, named", [
    (["--server", URL, "--threads", "2"], "--threads"),
    (["--kv-dtype", "fp8", "--server", URL], "--kv-dtype"),
    (["ask", "--server", URL, "--weights", "int8", "--dtype", "bf16", "hello"], "--dtype, --weights"),
    (["--gpu-memory", "0.5", "ask", "--server", URL, "hello"], "--gpu-memory"),
], ids=["tui threads", "tui kv-dtype (its default value)", "ask two flags", "top-level flag before ask"])
def test_local_model_options_with_a_server_are_one_line(capsys, kvchat_home, argv, named):
    before = _kvchat_variables()
    assert main(argv) == 2
    assert _kvchat_variables() == before, "a refused command sets no KVCHAT_* variable (later work would inherit it)"
    line = one_line(capsys)
    assert f"kvchat: error: {named} set" in line and "up a local model; with --server the server's own" in line, line
    assert not kvchat_home.exists()


def test_local_model_options_with_kvchat_server_and_json(capsys, monkeypatch, kvchat_home):
    monkeypatch.setenv("KVCHAT_SERVER", URL)
    assert main(["ask", "--json", "--threads", "1", "hello"]) == 2
    err = json.loads(capsys.readouterr().out)["error"]
    assert err["message"] == ("--threads sets up a local model; with KVCHAT_SERVER the server's own settings "
                              "apply: drop it") and err["exit_status"] == 2, err
    assert not kvchat_home.exists()


@pytest.mark.parametrize("url, words", [("http://127.0.0.1:99999", "Port out of range"),
                                        ("http://[::1", "Invalid IPv6 URL"),
                                        ("http://me:pw@[::1", "user or password")])
def test_a_server_url_that_is_not_a_url_is_one_line_naming_it(capsys, kvchat_home, url, words):
    assert main(["ask", "--server", url, "hello"]) == 2
    line = one_line(capsys)
    assert words in line and ("pw" not in line if "@" in url else url in line), line
    assert not kvchat_home.exists()
