"""Kill loop: ``kill -9`` ``kvchat ask`` at random times during a scripted multi-turn chat, check after each kill.

Usage::

    python -m kvchat.bench.crash_loop --kills 50 [--seed 0] [--turns 6] [--max-tokens 16] [--json FILE]

First the script (:mod:`kvchat.bench.crash_script`) runs once with every
snapshot file deleted before each turn: the reference answers. Then, in a
fresh data dir, the same script runs one ``kvchat ask`` process per turn
(each turn restores the chat's K/V from disk, answers, stores the turn and
writes its new chunks from the background writer thread); with probability
``--kill-rate`` a process is SIGKILLed, either at a uniformly random time
over a whole turn ("anywhere") or at a random offset into a randomly chosen
phase ("phase": start-up, restore + prefill, decode, storing the turn,
snapshot writes), as its ``KVCHAT_PHASE_TRACE`` markers show. The phase a
kill really hit is the last marker the process wrote. A killed turn is
asked again by the next process; a conversation that completed its turns is
followed by ``kvchat cache purge --all`` and a new one, so every
conversation writes fresh chunks.

After every process: ``PRAGMA integrity_check`` is ok, no indexed chunk fails
its checksum, and every conversation holds exactly its completed turns with
the reference text and ids (:mod:`kvchat.bench.crash_checks`). Every answer
of a process that finished (a resume whenever it continues a chat) must
equal the reference answer. After the last kill one more turn resumes the
chat, then ``kvchat cache verify`` and ``kvchat cache gc`` run and the checks
run once more. Exit status 0 only when nothing was violated.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvchat.bench import PYTHON
from kvchat.bench.crash_checks import check_store
from kvchat.bench.crash_script import (
    AskRun,
    Reference,
    ScriptConfig,
    reference,
    start_ask,
    write_document,
)

PHASES = {  # marker last written -> the phase a kill then interrupts
    "startup": "start-up (imports, model load, chat lookup)",
    "loaded": "restore from disk + prefill",
    "decoding": "decode",
    "generated": "storing the turn (SQLite transaction)",
    "committed": "snapshot writes (background writer) + flush",
    "flushed": "exit after the flush",
}
TARGET_PHASES = ("startup", "loaded", "decoding", "generated", "committed")
MIN_PHASE_WINDOW_S = 0.005
POLL_S = 0.005


@dataclass(slots=True)
class Kill:
    """One SIGKILL: the turn (1-based), the plan, the phase it really hit, and what the store showed after."""

    turn: int
    mode: str
    planned_phase: str | None
    phase: str
    after_s: float
    turn_stored: bool
    files_without_row: int
    rows_without_file: int


@dataclass(slots=True)
class LoopReport:
    """Everything the loop measured; ``problems`` empty means every check held."""

    kills: list[Kill] = field(default_factory=list)
    launches: int = 0
    finished: int = 0
    resumes: int = 0
    resumes_after_kill: int = 0
    answers_checked: int = 0
    answers_equal: int = 0
    restored_tokens: list[int] = field(default_factory=list)
    conversations: int = 0
    store_checks: int = 0
    integrity_ok: int = 0
    corrupt_seen: int = 0
    max_files_without_row: int = 0
    rows_without_file_seen: int = 0
    final_verify: str = ""
    final_gc: str = ""
    final_rows_without_file: int = -1
    wall_s: float = 0.0
    problems: list[str] = field(default_factory=list)
    reference: Reference | None = None

    def summary(self) -> dict:
        """Counts for docs/reliability.md: kills per phase and mode, checks run and passed."""
        return {
            "kills": len(self.kills),
            "kills_by_phase": dict(Counter(PHASES[k.phase] for k in self.kills)),
            "kills_by_mode": dict(Counter(k.mode for k in self.kills)),
            "kills_after_commit": sum(k.turn_stored for k in self.kills),
            "kills_leaving_file_without_row": sum(k.files_without_row > 0 for k in self.kills),
            "launches": self.launches, "finished": self.finished, "resumes": self.resumes,
            "resumes_after_kill": self.resumes_after_kill,
            "answers_equal_reference": f"{self.answers_equal}/{self.answers_checked}",
            "conversations": self.conversations,
            "integrity_ok": f"{self.integrity_ok}/{self.store_checks}",
            "corrupt_chunks_seen": self.corrupt_seen, "rows_without_file_seen": self.rows_without_file_seen,
            "max_files_without_row": self.max_files_without_row,
            "final_verify": self.final_verify, "final_gc": self.final_gc,
            "wall_s": round(self.wall_s, 1), "problems": len(self.problems),
        }


def _kill_plan(rng: random.Random, ref: Reference, turn: int, kill_rate: float) -> tuple[str, str | None, float] | None:
    """None (let it finish) or (mode, phase to wait for or None, seconds to wait after it / after the start)."""
    if rng.random() >= kill_rate:
        return None
    durations = ref.durations[turn]
    if rng.random() < 0.5:
        return "anywhere", None, rng.uniform(0.0, sum(durations.values()))
    phase = rng.choice(TARGET_PHASES)
    return "phase", phase, rng.uniform(0.0, max(durations.get(phase, 0.0), MIN_PHASE_WINDOW_S))


def _run_with_kill(run: AskRun, plan: tuple[str, str | None, float] | None) -> str | None:
    """Let ``run`` finish, or SIGKILL it as ``plan`` says; returns the phase the kill hit (None: not killed)."""
    if plan is None:
        run.wait()
        return None
    _, phase, delay = plan
    t0 = run.started
    while phase not in (None, "startup"):
        if run.proc.poll() is not None:
            break
        hit = next((t for t, p in run.phases() if p == phase), None)
        if hit is not None:
            t0 = hit
            break
        time.sleep(POLL_S)
    while run.proc.poll() is None and time.time() < t0 + delay:
        time.sleep(min(POLL_S, max(t0 + delay - time.time(), 0.0)))
    if run.proc.poll() is None:
        os.kill(run.proc.pid, signal.SIGKILL)
    run.wait()
    if run.returncode != -signal.SIGKILL:
        return None
    markers = run.phases()
    return markers[-1][1] if markers else "startup"


def _cli(home: Path, cfg: ScriptConfig, *args: str) -> str:
    env = {**os.environ, "KVCHAT_HOME": str(home)}
    if cfg.models is not None:
        env["KVCHAT_MODELS"] = str(cfg.models)
    r = subprocess.run([*PYTHON, "-m", "kvchat.cli", *args], capture_output=True, text=True, env=env,
                       timeout=600, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"kvchat {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout.strip()


class _Loop:
    def __init__(self, cfg: ScriptConfig, home: Path, doc: Path, work: Path, ref: Reference, log):
        self.cfg, self.home, self.doc, self.work, self.ref, self.log = cfg, home, doc, work, ref, log
        self.report = LoopReport()
        self.chat_id: str | None = None
        self.turn = 0  # completed turns of the current conversation
        self.known: set[str] = set()
        self.after_kill = False
        self.last_killed = False

    def check(self, killed_phase: str | None = None):
        c = check_store(self.home, self.ref)
        r = self.report
        r.store_checks += 1
        r.integrity_ok += c.integrity == "ok"
        r.corrupt_seen += c.corrupt
        r.rows_without_file_seen += c.rows_without_file
        r.max_files_without_row = max(r.max_files_without_row, c.files_without_row)
        r.problems += [q for q in c.problems if q not in r.problems]  # a damaged chat is reported once
        new = set(c.turns) - self.known
        if len(new) > 1 or (new and self.chat_id is not None):
            r.problems.append(f"unexpected conversations appeared: {sorted(new)}")
        if new and self.chat_id is None:
            self.chat_id = new.pop()
            self.known.add(self.chat_id)
        stored = c.turns.get(self.chat_id, 0) if self.chat_id else 0
        may_commit = killed_phase in ("generated", "committed", "flushed")
        must_commit = killed_phase in ("committed", "flushed")
        if not (stored == self.turn or (stored == self.turn + 1 and may_commit)) or (must_commit and stored != self.turn + 1):
            r.problems.append(f"{self.chat_id}: {stored} turns stored after {self.turn} completed "
                              f"(kill in phase {killed_phase})")
        return c, stored

    def step(self, rng: random.Random, kill_rate: float) -> None:
        r, turn = self.report, self.turn
        run = start_ask(self.cfg, self.home, turn, self.chat_id, self.doc, self.work / f"run-{r.launches}.trace")
        r.launches += 1
        plan = _kill_plan(rng, self.ref, turn, kill_rate)
        phase = _run_with_kill(run, plan)
        self.last_killed = phase is not None
        if phase is None and run.returncode != 0:
            r.problems.append(f"turn {turn + 1} exited {run.returncode}: {run.stderr.strip()[-300:]}")
            raise RuntimeError(r.problems[-1])
        if phase is None:
            self._finished(run, turn)
        c, stored = self.check(phase)
        if phase is not None:
            k = Kill(turn + 1, plan[0], plan[1], phase, round(time.time() - run.started, 3), stored > turn,
                     c.files_without_row, c.rows_without_file)
            r.kills.append(k)
            self.log(f"kill {len(r.kills)}: turn {k.turn}, {k.mode} ({k.planned_phase or '-'}), hit "
                     f"'{PHASES[phase]}' after {k.after_s:.2f} s; turn stored: {k.turn_stored}; "
                     f"files without row {k.files_without_row}, rows without file {k.rows_without_file}; "
                     f"integrity {c.integrity}; problems so far {len(r.problems)}")
            self.turn = stored
            if self.turn:
                self.after_kill = True
        if self.turn == self.cfg.turns:
            self.log(_cli(self.home, self.cfg, "cache", "purge", "--all") + f" (conversation {self.chat_id} done)")
            self.chat_id, self.turn = None, 0
            self.after_kill = False

    def _finished(self, run: AskRun, turn: int) -> None:
        r, res = self.report, run.result
        r.finished += 1
        if self.chat_id is None:
            self.chat_id = res["chat_id"]
            self.known.add(self.chat_id)
        if turn:
            r.resumes += 1
            r.restored_tokens.append(res["from_disk"])
            r.resumes_after_kill += self.after_kill
        r.answers_checked += 1
        if res["text"] == self.ref.answers[turn]:
            r.answers_equal += 1
        else:
            r.problems.append(f"turn {turn + 1} of {self.chat_id} answered {res['text']!r}, "
                              f"reference (snapshot files deleted) {self.ref.answers[turn]!r}")
        self.log(f"turn {turn + 1} of {self.chat_id} done: from_disk {res['from_disk']}, "
                 f"prefilled {res['prefilled_tokens']}, miss {res['miss_reason']}, answer equal: "
                 f"{res['text'] == self.ref.answers[turn]}")
        self.turn = turn + 1
        self.after_kill = False

    def finish(self) -> None:
        """A last resume after the final kill, then ``cache verify`` and ``cache gc``, then the checks again."""
        r = self.report
        if self.last_killed:
            self.step(random.Random(0), 0.0)
        r.final_verify = _cli(self.home, self.cfg, "cache", "verify")
        r.final_gc = _cli(self.home, self.cfg, "cache", "gc")
        c, _ = self.check()
        r.final_rows_without_file = c.rows_without_file
        r.conversations = len(self.known)
        if c.rows_without_file or c.corrupt:
            r.problems.append(f"after cache verify: {c.rows_without_file} rows without file, {c.corrupt} corrupt")


def run_loop(kills: int, *, home: Path, work: Path, cfg: ScriptConfig | None = None, seed: int = 0,
             kill_rate: float = 0.7, max_launches: int | None = None, log=print) -> LoopReport:
    """Run the reference, then launch turns until ``kills`` processes were killed, then finish and check.

    Args:
        kills: SIGKILLs to deliver (processes that finish before their kill time do not count).
        home: an empty data dir for the loop (the reference uses ``work/reference-home``).
        work: scratch dir for the document, traces and the reference's data dir.
        cfg: turns per conversation, answer length, threads, models dir.
        seed: seeds kill decisions and times (process timing still varies run to run).
        kill_rate: probability that a launch is to be killed.
        max_launches: safety stop (default ``5 * kills + 20``).
    Returns:
        The report; ``report.problems`` lists every violated requirement.
    Raises:
        CrashScriptError: the reference run failed.
        RuntimeError: a turn that was not killed failed, or a cache command failed.
    """
    cfg = cfg or ScriptConfig()
    rng = random.Random(seed)
    t0 = time.time()
    work.mkdir(parents=True, exist_ok=True)
    doc = write_document(work / "stdlib-docstrings.txt")
    log(f"reference: {cfg.turns} turns, snapshot files deleted before each")
    ref = reference(cfg, work / "reference-home", doc, work)
    loop = _Loop(cfg, home, doc, work, ref, log)
    loop.report.reference = ref
    limit = max_launches or 5 * kills + 20
    while len(loop.report.kills) < kills and loop.report.launches < limit:
        loop.step(rng, kill_rate)
    loop.finish()
    loop.report.wall_s = time.time() - t0
    return loop.report


def main(argv: list[str] | None = None) -> int:
    """``python -m kvchat.bench.crash_loop``: prints progress and a JSON summary; exit 0 iff nothing was violated."""
    p = argparse.ArgumentParser(prog="python -m kvchat.bench.crash_loop", description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    default = ScriptConfig()
    p.add_argument("--turns", type=int, default=default.turns, help="turns per conversation")
    p.add_argument("--max-tokens", type=int, default=default.max_tokens)
    p.add_argument("--threads", type=int, default=default.threads)
    p.add_argument("--kill-rate", type=float, default=0.7)
    p.add_argument("--work", type=Path, help="scratch dir (default: a new temp dir)")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the full report as JSON")
    args = p.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="kvchat-crash-"))
    cfg = ScriptConfig(args.turns, args.max_tokens, args.threads)
    home = work / "home"
    report = run_loop(args.kills, home=home, work=work, cfg=cfg, seed=args.seed, kill_rate=args.kill_rate,
                      log=lambda s: print(s, flush=True))
    print(json.dumps(report.summary(), indent=2))
    for line in report.problems:
        print(f"PROBLEM: {line}")
    if args.json:
        full = asdict(report)
        full["reference"] = {"answers": report.reference.answers, "durations": report.reference.durations}
        args.json.write_text(json.dumps({"summary": report.summary(), "report": full}, indent=2))
    return 0 if not report.problems else 1


if __name__ == "__main__":
    sys.exit(main())
