"""argparse usage errors follow the CLI rule: one ``kvchat: error:`` line on stderr, exit status 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvchat.cli.main import main

USAGE_ERRORS = [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["ask"], "required: prompt"),
    (["ask", "hi", "--max-tokens", "many"], "invalid int value: 'many'"),
    (["ask", "hi", "--kv-dtype", "fp4"], "invalid choice: 'fp4'"),
    (["cache"], "required: COMMAND"),
    (["cache", "nope"], "invalid choice: 'nope'"),
    (["model", "pull", "--from"], "expected one argument"),
    (["plan", "--gpu-gb", "lots"], "invalid float value"),
    (["ask", "hi", "--bogus"], "unrecognized arguments: --bogus (see 'kvchat ask --help')"),
    (["cache", "ls", "--bogus"], "unrecognized arguments: --bogus (see 'kvchat cache ls --help')"),
]


@pytest.mark.parametrize("argv, fragment", USAGE_ERRORS)
def test_usage_error_is_one_line_exit_2(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out, err = capsys.readouterr()
    assert exc.value.code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.endswith("\n")
    assert err.startswith("kvchat: error: ") and fragment in err and "usage:" not in err


def test_usage_error_from_the_installed_entry_point(kvchat_home):
    """The real process: exit status 2, one line, the sub-command's help named, data dir untouched."""
    proc = subprocess.run([sys.executable, "-m", "kvchat.cli", "ask", "hi", "--top-k", "x"], capture_output=True, check=False,
                          text=True, env={**os.environ, "KVCHAT_HOME": str(kvchat_home)}, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "kvchat: error: argument --top-k: invalid int value: 'x' (see 'kvchat ask --help')"]
    assert not kvchat_home.exists()


def test_help_and_version_are_not_errors(capsys):
    for argv in (["--help"], ["cache", "--help"], ["--version"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 0
    out, err = capsys.readouterr()
    assert "usage: kvchat cache" in out and err == ""


def test_model_pull_from_checks_the_file_even_when_already_imported(smol_dir, tmp_path, capsys):
    garbage = tmp_path / "model.gguf"
    garbage.write_bytes(b"GGUF" + bytes(64))
    assert main(["model", "pull", "--from", str(garbage)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvchat: error: ")


def test_every_bench_command_names_its_runner():
    """``kvchat bench NAME`` runs ``kvchat.bench.NAME.cmd_bench_NAME``: each listed command has one."""
    import importlib

    from kvchat.bench.args import COMMANDS

    for name, _, _ in COMMANDS:
        assert callable(getattr(importlib.import_module(f"kvchat.bench.{name}"), f"cmd_bench_{name}")), name


def test_ask_help_shows_every_sampling_default(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["ask", "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    for shown in ("--max-tokens MAX_TOKENS most tokens to answer (default: 512)", "(default: 1.0 = off)",
                  "(default: 0 = off)", "--seed SEED sampling seed (default: none", "(default: 0.0)"):
        assert shown in text, text


@pytest.mark.parametrize("argv, option, value", [
    (["ask", "--server", "http://127.0.0.1:8766", "--api-key", "sekrit", "hi"], "--api-key", "sekrit"),
    (["ask", "hi", "--api-key=sekrit"], "--api-key", "sekrit"),
    (["ask", "--max", "3", "hi"], "--max", "3"),
    (["ask", "--temp", "0", "hi"], "--temp", "0"),
    (["--mod=SmolLM2", "ask", "hi"], "--mod", "SmolLM2"),
    (["--api-key", "sekrit", "ask", "hi"], "--api-key", "sekrit"),
    (["--model", "SmolLM2", "--threads", "2", "--api-key", "sekrit", "ask", "hi"], "--api-key", "sekrit"),
    (["cache", "--api-key", "sekrit", "ls"], "--api-key", "sekrit"),
    (["bench", "resume", "--mod", "SmolLM2"], "--mod", "SmolLM2"),
])
def test_abbreviated_options_are_unknown_and_their_value_is_not_echoed(argv, option, value, capsys):
    """No parser of the command completes a prefix to an option (``--api-key`` is not ``--api-key-env``);
    the error names the unknown option alone, never the word after it, which may be a secret."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"kvchat: error: unrecognized arguments: {option} (see ")
    assert value not in err


def test_abbreviated_option_with_json_is_a_usage_error_object(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["ask", "--json", "--api-key", "sekrit", "hi"])
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and err == ""
    error = json.loads(out)["error"]
    assert error["type"] == "usage_error" and "--api-key" in error["message"] and "sekrit" not in out


@pytest.mark.parametrize("argv, fragment", [
    (["plan", "--json", "--gpu-gb", "lots"], "invalid float value"),
    (["cache", "explain", "--json"], "required: chat"),
    (["--model", "bench", "ask", "--json"], "required: prompt"),  # an option's value that names a command
    (["--model=bench", "ask", "--json"], "required: prompt"),
])
def test_usage_errors_of_json_commands_are_error_objects(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out, err = capsys.readouterr()
    error = json.loads(out)["error"]
    assert exc.value.code == 2 and err == "" and error["type"] == "usage_error" and fragment in error["message"]


@pytest.mark.parametrize("argv", [
    ["bench", "resume", "--json", "ask", "--bogus"],  # bench's --json takes a file
    ["doc", "add", "plan", "--json", "--bogus"],  # a document named plan; doc add has no --json
    ["cache", "pin", "explain", "--json", "--bogus"],  # a chat id that is a command's name
    ["ask", "hi", "--", "--json", "x"],  # after --: words, not options
])
def test_json_errors_only_for_a_command_whose_json_is_a_flag(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and out == "" and err.startswith("kvchat: error: ") and err.count("\n") == 1


@pytest.mark.parametrize("argv, wanted", [
    (["ask", "hi", "--json"], True), (["--threads", "3", "plan", "--json"], True),
    (["cache", "--", "explain", "--json"], False), (["cache", "explain", "c_1"], False),
    (["--model", "cache", "explain", "--json"], False),  # 'cache' is --model's value: the command is explain
    ([], False), (["-", "--json"], False),
])
def test_asks_json_follows_the_parsers(argv, wanted):
    from kvchat.cli.main import asks_json, build_parser

    assert asks_json(argv, build_parser()) is wanted
