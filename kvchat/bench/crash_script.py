"""The scripted conversation of the kill loop, and its reference answers with no snapshot files.

A conversation is a document (the first ``DOC_CHARS`` characters of the
standard-library docstrings, :mod:`kvchat.texts`; about 350 tokens, so
turn 1 already writes a full 256-token chunk plus tails) and ``QUESTIONS``
asked in order, one ``kvchat ask`` process per turn: turn 1 with ``--doc``,
later turns with ``--chat``. Decoding is greedy, so every turn has one right
answer.

The reference answer of turn k is what ``kvchat ask`` gives when the chat's
snapshot files are deleted first (every file under ``<home>/kv``, rows left
in place): the process finds the rows, fails to read the files, drops them
and recomputes everything from the stored token ids.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvchat.bench import PYTHON
from kvchat.phase_trace import TRACE_ENV, read_trace

DOC_CHARS = 1500
DOC_NAME = "stdlib-docstrings.txt"
QUESTIONS = (
    "What is this document about?",
    "Name one function or option it mentions.",
    "Summarize the first paragraph in one sentence.",
    "What might confuse a beginner here?",
    "Give the document a short title.",
    "List two keywords from it.",
    "Which Python module is it from?",
    "Say it again, shorter.",
)
ASK_TIMEOUT_S = 600


class CrashScriptError(RuntimeError):
    """A turn that must succeed failed (exit status, output or stored state not as required)."""


@dataclass(slots=True)
class ScriptConfig:
    """How each turn is run: ``turns`` questions (at most ``len(QUESTIONS)``), answer length, threads, models dir."""

    turns: int = 6
    max_tokens: int = 16
    threads: int = 1
    models: Path | None = None


@dataclass(slots=True)
class AskRun:
    """One ``kvchat ask`` process: argv, when it started, its trace file and (once ended) its outcome.

    Attributes:
        returncode: exit status (negative: killed by that signal); None while running.
        result: the ``--json`` object of a run that exited 0.
    """

    proc: subprocess.Popen
    started: float
    trace: Path
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""
    result: dict | None = None

    def phases(self) -> list[tuple[float, str]]:
        """The phase markers the process wrote so far (see :mod:`kvchat.phase_trace`)."""
        return read_trace(self.trace)

    def wait(self) -> AskRun:
        """Wait for the process to end and collect its output (JSON parsed when it exited 0)."""
        self.stdout, self.stderr = self.proc.communicate(timeout=ASK_TIMEOUT_S)
        self.returncode = self.proc.returncode
        if self.returncode == 0:
            self.result = json.loads(self.stdout)
        return self


@dataclass(slots=True)
class Reference:
    """Per turn k (0-based): the answer text, the conversation's token ids after it, phase durations (s)."""

    answers: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    durations: list[dict[str, float]] = field(default_factory=list)


def write_document(path: Path) -> Path:
    """Write the script's document to ``path`` and return it."""
    from kvchat.texts import stdlib_text

    path.write_text(stdlib_text().text[:DOC_CHARS])
    return path


def start_ask(cfg: ScriptConfig, home: Path, turn: int, chat_id: str | None, doc: Path, trace: Path) -> AskRun:
    """Start ``kvchat ask`` for turn ``turn`` (0-based): a new chat on ``doc`` when ``chat_id`` is None.

    Raises:
        ValueError: ``turn`` is beyond the script's questions.
    """
    if not 0 <= turn < len(QUESTIONS):
        raise ValueError(f"turn {turn} is outside the script's {len(QUESTIONS)} questions")
    where = ["--chat", chat_id] if chat_id else ["--doc", str(doc)]
    argv = [*PYTHON, "-m", "kvchat.cli", "ask", QUESTIONS[turn], *where, "--json",
            "--max-tokens", str(cfg.max_tokens), "--threads", str(cfg.threads)]
    env = {**os.environ, "KVCHAT_HOME": str(home), TRACE_ENV: str(trace)}
    if cfg.models is not None:
        env["KVCHAT_MODELS"] = str(cfg.models)
    trace.unlink(missing_ok=True)
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return AskRun(proc, time.time(), trace)


def phase_durations(run: AskRun) -> dict[str, float]:
    """Seconds from the process start to the first marker and between markers, keyed by the phase entered last."""
    out, last, name = {}, run.started, "startup"
    for t, phase in run.phases():
        out[name] = max(t - last, 0.0)
        last, name = t, phase
    return out


def delete_snapshot_files(home: Path) -> int:
    """Delete every file under ``<home>/kv`` (the index rows stay); returns how many."""
    files = [p for p in (home / "kv").rglob("*") if p.is_file()]
    for p in files:
        p.unlink()
    return len(files)


def stored_conversation(home: Path, chat_id: str):
    """The conversation as stored in ``home`` (a read of the SQLite index; migrations run if needed)."""
    from kvchat.store.conversations import get_conversation
    from kvchat.store.db import connect

    db = connect(home / "kvchat.db")
    try:
        return get_conversation(db, chat_id)
    finally:
        db.close()


def reference(cfg: ScriptConfig, home: Path, doc: Path, work: Path) -> Reference:
    """Run the whole script once in ``home``, deleting every snapshot file before each turn.

    Raises:
        CrashScriptError: a turn failed, or restored anything from disk.
    """
    ref, chat_id = Reference(), None
    for turn in range(cfg.turns):
        delete_snapshot_files(home)
        run = start_ask(cfg, home, turn, chat_id, doc, work / f"reference-{turn}.trace").wait()
        if run.returncode != 0:
            raise CrashScriptError(f"reference turn {turn + 1} failed ({run.returncode}): {run.stderr.strip()[-500:]}")
        if run.result["from_disk"] or run.result["from_memory"]:
            raise CrashScriptError(f"reference turn {turn + 1} reused cached K/V: {run.result}")
        chat_id = run.result["chat_id"]
        ref.answers.append(run.result["text"])
        ref.token_ids.append(stored_conversation(home, chat_id).token_ids)
        ref.durations.append(phase_durations(run))
    return ref
