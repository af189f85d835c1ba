"""What the chat screen allows while engine work runs: one table, asked by every action that needs the engine.

At most one job runs at a time (the engine does one thing at once and the chat pane shows one chat): a
document attach (read, tokenize, prefill: it ends by opening the document's chat), a turn (an answer
streams), or a short call (open, new chat, delete, system prompt, continue in a new chat). Each user action
is then allowed, queued, refused with one notice (a refused message stays in the input), or it cancels the job:

============  ====================  ==================  ==================
action        attach                turn                short call
============  ====================  ==================  ==================
send          queued (one message)  refused             refused
edit, regen   refused               refused             refused
chat change   refused               refused             refused
Esc           cancels (no chat)     cancels (kept)      nothing to cancel
quit          cancels, then quits   cancels, then quits waits, then quits
============  ====================  ==================  ==================

A queued message is sent to the document's chat once it opens; when the attach fails or is cancelled, it
goes back into the input. "chat change" is any action that replaces the open chat or the engine's state
(new chat, attach, open from the sidebar, delete, system prompt, continue in a new chat); renaming, search,
settings, help, copy and export touch neither and are always allowed.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Job(Enum):
    """Engine work in flight; the value is how a refusal names it."""

    ATTACH = "a document is being attached (Esc cancels it)"
    TURN = "an answer is being generated (Esc stops it)"
    CALL = "the chat is being switched; try again in a moment"


class Act(Enum):
    """User actions that need the engine or change what the open chat is."""

    SEND = "send"
    EDIT = "edit"  # F4, and Enter while editing
    REGENERATE = "regenerate"
    CHANGE_CHAT = "change chat"
    CANCEL = "cancel"  # Esc
    QUIT = "quit"


class Verdict(Enum):
    ALLOW = "allow"
    QUEUE = "queue"
    REFUSE = "refuse"
    CANCEL = "cancel"


@dataclass(frozen=True, slots=True)
class Decision:
    """``verdict`` and, for REFUSE, the one-line notice that says why."""

    verdict: Verdict
    reason: str = ""


ALREADY_QUEUED = "a message is already waiting for the document; it is sent once the document is ready"
CANCELLABLE = (Job.ATTACH, Job.TURN)


def decide(act: Act, job: Job | None, queued: bool = False, not_ready: str = "") -> Decision:
    """The verdict for ``act`` while ``job`` runs (None: nothing runs), as in the module's table.

    ``queued``: a message already waits for the running attach; ``not_ready``: why the engine cannot work
    at all ("the model is still loading", a failed load), refusing every engine action but Esc and quit.
    """
    if act in (Act.CANCEL, Act.QUIT):
        return Decision(Verdict.CANCEL if job in CANCELLABLE else Verdict.ALLOW)
    if not_ready:
        return Decision(Verdict.REFUSE, not_ready)
    if job is None:
        return Decision(Verdict.ALLOW)
    if job is Job.ATTACH and act is Act.SEND:
        return Decision(Verdict.REFUSE, ALREADY_QUEUED) if queued else Decision(Verdict.QUEUE)
    return Decision(Verdict.REFUSE, job.value)
