"""CUDA graphs of the decode step: one per (batch bucket, context bucket), replayed per token.

A decode step of a small model is launch-bound (10 kernel launches per layer with the fused Triton
kernels, ``kvchat.bench.launch_count``); replaying a captured graph issues them as one. As nano-vllm's ``model_runner.py``
does, the graph is captured over
the persistent input tensors (:mod:`kvchat.engine.decode_buffers`): each step writes its values into
them and replays. Within one (batch, context) bucket pair every launch parameter is fixed (the Triton
decode kernel's split count follows the block-table view's width, its row stride is the full table's),
which is what makes the capture valid for every step of that bucket pair.

Capture is lazy: the first step of a bucket pair runs the step eagerly on a side stream (compiling
anything the load-time warm-up did not, ``kernels/warmup.py``, and settling the allocator), then
captures it and replays it. Both runs write the same K/V to the same slots, so the extra run changes
nothing. A capture that fails leaves one notice and eager decode for the rest of the process.

:func:`graphs_wanted` is the pure choice (CUDA, the Triton backend, ``KVCHAT_CUDA_GRAPHS`` not ``0``);
CPU engines run eager and never construct :class:`DecodeGraphs`.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

_log = logging.getLogger(__name__)


def graphs_wanted(device: torch.device, backend: str, enabled: bool) -> bool:
    """Whether decode runs as CUDA graphs: on a CUDA ``device`` with the ``triton`` attention ``backend``
    (the reference kernels read lengths back on the host, which a graph cannot) when ``enabled``
    (``KVCHAT_CUDA_GRAPHS``)."""
    return enabled and device.type == "cuda" and backend == "triton"


class DecodeGraphs:
    """Captured decode steps, keyed by ``(rows, width)``.

    ``step(rows, width)`` runs one decode forward over the persistent buffers' views and returns float32
    logits ``[rows, vocab_size]`` (:meth:`kvchat.engine.runner.Engine.paged_decode_step`).

    Attributes:
        enabled: replay graphs (False: every step eager, e.g. to measure both).
        failed: why capture failed (then every step runs eager), else None.
    """

    def __init__(self, step: Callable[[int, int], torch.Tensor]):
        self._step = step
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.enabled = True
        self.failed: str | None = None

    @property
    def captured(self) -> list[tuple[int, int]]:
        """The ``(rows, width)`` bucket pairs captured so far."""
        return sorted(self._graphs)

    def __call__(self, rows: int, width: int) -> torch.Tensor:
        """The step's logits, float32 ``[rows, vocab_size]`` (a fresh tensor: the next replay does not touch it)."""
        if not self.enabled or self.failed is not None:
            return self._step(rows, width)
        entry = self._graphs.get((rows, width))
        if entry is None:
            try:
                entry = self._capture(rows, width)
            except Exception as exc:  # noqa: BLE001 - any capture failure: eager from now on, said once
                self.failed = f"{type(exc).__name__}: {exc}"
                _log.warning("kvchat: CUDA graph capture of decode failed (%s); decoding without graphs", self.failed)
                return self._step(rows, width)
        graph, out = entry
        graph.replay()
        return out.clone()

    def _capture(self, rows: int, width: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # eager once: compiles and allocates outside the capture
            self._step(rows, width)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # other threads (the snapshot
            # writer waiting on its copy, a restore's lanes) may use CUDA meanwhile
            out = self._step(rows, width)
        self._graphs[(rows, width)] = (graph, out)
        return graph, out
