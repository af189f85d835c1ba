"""Wall time of work on a device, the one place the engine measures it.

On CUDA, kernels run asynchronously: a host clock read after a launch measures
the launch, not the work. :class:`DeviceTimer` records a CUDA event on the
device's current stream at start and at stop, and waits for the stop event
before reading the elapsed time (``torch.cuda.Event.elapsed_time``, ms, the
GPU's own clock), so ``prefill_ms``, ``restore_ms`` and decode timings are
what the device took. On CPU it is ``time.perf_counter``.

Decode timing (``decode_tokens_per_s``, TTFT in :mod:`kvchat.engine.session`)
reads the host clock after each sampled token id has reached the host; that
read is itself a sync, so those figures need no event.
"""

from __future__ import annotations

import time

import torch


class DeviceTimer:
    """Elapsed milliseconds of the work queued between :meth:`start` and :meth:`stop` on ``device``.

    Use as ``with DeviceTimer(dev) as t: ...`` then ``t.ms``, or call
    :meth:`start`/:meth:`stop` (``stop`` returns ms and may be called again to
    extend the interval).
    """

    __slots__ = ("device", "ms", "_t0", "_start", "_cuda")

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self.ms = 0.0
        self._t0 = 0.0
        self._start = None

    def start(self) -> "DeviceTimer":
        """Mark the start (a CUDA event on the current stream of ``device``, or the host clock)."""
        if self._cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record(torch.cuda.current_stream(self.device))
        else:
            self._t0 = time.perf_counter()
        return self

    def stop(self) -> float:
        """Wait for the work queued so far and return the elapsed ms since :meth:`start` (also in ``ms``)."""
        if self._cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record(torch.cuda.current_stream(self.device))
            end.synchronize()
            self.ms = self._start.elapsed_time(end)
        else:
            self.ms = (time.perf_counter() - self._t0) * 1e3
        return self.ms

    def __enter__(self) -> "DeviceTimer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
