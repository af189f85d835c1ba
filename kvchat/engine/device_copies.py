"""Copies into a CUDA pool from several reader threads, overlapped: one side stream per thread.

A restore (:meth:`kvchat.engine.persistence.KVPersist.restore`) reads chunk files on several threads.
On CUDA each thread reads into its own pinned host buffer (page-locked: the copy engine reads it
directly, and ``non_blocking`` copies return at once), verifies the checksum on those host bytes, then
queues the copy into the pool on its own side stream (its *lane*), so the next file's read and
checksum overlap this file's copy. Each lane starts after the work already queued on the main stream
(the pool's copy-on-write before a restore) and records an event after each chunk: the lane waits for
its own last event before it overwrites its pinned buffer, and :meth:`DeviceCopies.join` makes the
main stream wait for every lane before anything reads the pool. On a CPU every call is a no-op and
the copies are plain, synchronous ones (``pin_memory`` needs CUDA).
"""

from __future__ import annotations

import threading

import torch


class Lane:
    """One reader thread's side stream (CUDA) or nothing (CPU); ``with lane:`` runs copies on it."""

    def __init__(self, owner: "DeviceCopies"):
        self._owner = owner
        self._stream = torch.cuda.Stream(owner.device) if owner.cuda else None
        self._done: torch.cuda.Event | None = None
        self._ctx = None
        if self._stream is not None:
            self._stream.wait_event(owner.ready)

    def wait_buffer_free(self) -> None:
        """Block until this lane's last copy finished reading its pinned buffer (CPU: nothing to wait for)."""
        if self._done is not None:
            self._done.synchronize()

    def __enter__(self) -> "Lane":
        if self._stream is not None:
            self._ctx = torch.cuda.stream(self._stream)
            self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._stream is None:
            return
        self._done = torch.cuda.Event()
        self._done.record(self._stream)
        self._ctx.__exit__(*exc)
        self._owner._add(self._done)


class DeviceCopies:
    """The lanes of one restore on ``device`` (see module doc).

    Attributes:
        cuda: whether ``device`` is a CUDA device (pinned staging, side streams).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.ready = None
        if self.cuda:
            self.ready = torch.cuda.Event()
            self.ready.record(torch.cuda.current_stream(device))
        self._events: list[torch.cuda.Event] = []
        self._lock = threading.Lock()

    def lane(self) -> Lane:
        """A new lane (one per reader thread)."""
        return Lane(self)

    def _add(self, event: torch.cuda.Event) -> None:
        with self._lock:
            self._events.append(event)

    def join(self) -> None:
        """Make the current (main) stream wait for every copy queued on a lane so far (no host wait)."""
        if not self.cuda:
            return
        stream = torch.cuda.current_stream(self.device)
        with self._lock:
            for event in self._events:
                stream.wait_event(event)
