"""``torch.inference_mode`` for forwards outside the engine loop's thread: the one helper that enters it.

The engine loop holds the mode for every turn it drives (:mod:`kvchat.engine.loop`). What forwards elsewhere
enters it here: the engine's calls that benchmarks and tests make by hand
(:meth:`kvchat.engine.runner.Engine.decode`, ``score``, ``decode_batch``, ``sink_kv``: on the loop it is
held already), the engine's load (calibration, the activation peak), a restore's reader threads. Under it no
autograd state is recorded, and the tensors made are inference tensors, which only code under it may update
in place: the pool's sinks and the dense copy are made and written under it alone.
"""

from __future__ import annotations

import torch


def inference():
    """A context manager (also a decorator): ``torch.inference_mode()``."""
    return torch.inference_mode()
