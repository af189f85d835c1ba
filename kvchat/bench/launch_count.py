"""Count the kernel launches of a forward: torch operators that launch a kernel, plus Triton kernel launches.

A decode step of a small batch is launch-bound on a GPU: each launch costs a few microseconds of host
and device time whatever it computes, so the number of launches per decoder layer is what a decode
step's speed follows once its bytes are few. :class:`LaunchCounter` counts them on any device (on a
CPU under the Triton interpreter too, with the same code path a GPU runs):

- torch operators at the dispatcher (``TorchDispatchMode``: below autograd and below composite ops'
  decompositions, so ``F.linear`` counts as its one ``mm``/``addmm``), except those that launch nothing
  on CUDA: views and other metadata-only ops (``view``, ``reshape``'s alias, ``split``, ``slice``,
  ``detach``, ``t``; :attr:`torch._ops.OpOverload.is_view`) and bare allocations (``empty*``);
- Triton kernels, at ``kernel[grid](...)`` (``triton.runtime.jit.KernelInterface.__getitem__``, which
  both the compiled and the interpreted kernels inherit); the torch operators a launch runs itself
  (the interpreter's copies of its arguments) are not counted.

Launches are attributed to the decoder layer running them (forward hooks on ``model.layers``), so
:attr:`LaunchCounter.per_layer` is exact however many launches the step makes outside the layers
(embedding, final norm, logits, the step's input uploads).
"""

from __future__ import annotations

from collections import Counter
from contextlib import ExitStack, contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
NO_KERNEL = {_aten._unsafe_view, _aten.empty, _aten.empty_like, _aten.empty_strided, _aten.new_empty,
             _aten.new_empty_strided, _aten.set_, _aten.resize_}
"""Operators that are not views by their schema but launch nothing either: allocations, storage swaps and
an unchecked view."""


def launches_kernel(func) -> bool:
    """Whether the aten operator ``func`` launches a device kernel (not a view, metadata change or allocation)."""
    return not func.is_view and func.overloadpacket not in NO_KERNEL


def _composite(func, args) -> bool:
    """Whether ``func`` runs as a composite of other operators on the arguments' device.

    Under ``torch.inference_mode`` the autograd keys are skipped, so composite operators (``linear``,
    ``to``, ``reshape``) reach the dispatch mode whole instead of as what they run; an operator with a
    kernel of its own for the device (CUDA's ``_fused_rms_norm``) runs that kernel, not its composite.
    """
    if not torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
        return False
    cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
    return not torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CUDA" if cuda else "CPU")


class _Mode(TorchDispatchMode):
    """The dispatch mode recording the torch operators that launch a kernel into a :class:`LaunchCounter`."""

    def __init__(self, counter: "LaunchCounter"):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _composite(func, args):  # the ops it runs come back here one by one
            with self:
                return func.decompose(*args, **kwargs)
        if not self.counter._in_triton and launches_kernel(func):
            self.counter._record(str(func.overloadpacket.__name__))
        return func(*args, **kwargs)


class LaunchCounter:
    """A context manager counting kernel launches (see module doc), by place: inside a decoder layer or not.

    Use::

        with LaunchCounter(model.layers) as counter:
            engine.decode(seq, ids)
        counter.per_layer, counter.outside, counter.layer_ops

    Attributes:
        inside: launches made inside the decoder layers, all together.
        outside: launches made outside them.
        layer_ops: ``{name: count}`` of the launches inside the layers (aten operator or Triton kernel names).
        outside_ops: the same outside them.
        layers_run: decoder layer forwards seen (each layer once per forward).
    """

    def __init__(self, layers: torch.nn.ModuleList | None = None):
        self._layers = list(layers or [])
        self._stack: ExitStack | None = None
        self._depth = 0  # > 0 inside a decoder layer
        self._in_triton = 0  # > 0 inside a Triton launch: its own torch ops are not the model's
        self.inside = self.outside = self.layers_run = 0
        self.layer_ops: Counter[str] = Counter()
        self.outside_ops: Counter[str] = Counter()

    @property
    def per_layer(self) -> float:
        """Launches per decoder layer forward (``inside / layers_run``); 0.0 when no layer ran."""
        return self.inside / self.layers_run if self.layers_run else 0.0

    @property
    def total(self) -> int:
        """Every launch counted."""
        return self.inside + self.outside

    def _record(self, name: str) -> None:
        if self._depth:
            self.inside += 1
            self.layer_ops[name] += 1
        else:
            self.outside += 1
            self.outside_ops[name] += 1

    def _enter_layer(self, *_):
        self._depth += 1
        self.layers_run += 1

    def _leave_layer(self, *_):
        self._depth -= 1

    def __enter__(self) -> "LaunchCounter":
        stack = ExitStack()
        for layer in self._layers:
            stack.callback(layer.register_forward_pre_hook(self._enter_layer).remove)
            stack.callback(layer.register_forward_hook(self._leave_layer).remove)
        stack.enter_context(_count_triton(self))
        stack.enter_context(_Mode(self))
        self._stack = stack
        return self

    def __exit__(self, *exc) -> None:
        stack, self._stack = self._stack, None
        stack.__exit__(*exc)


@contextmanager
def _count_triton(counter: LaunchCounter):
    """Count every ``kernel[grid](...)`` launch into ``counter`` while active (no-op without Triton)."""
    try:
        from triton.runtime.jit import KernelInterface
    except ImportError:
        yield
        return
    original = KernelInterface.__getitem__

    def launcher(kernel, grid):
        launch = original(kernel, grid)

        def counted(*args, **kwargs):
            counter._record(getattr(kernel, "__name__", type(kernel).__name__))
            counter._in_triton += 1
            try:
                return launch(*args, **kwargs)
            finally:
                counter._in_triton -= 1

        return counted

    KernelInterface.__getitem__ = launcher
    try:
        yield
    finally:
        KernelInterface.__getitem__ = original


def decode_step_launches(engine, seq, token_ids) -> tuple[LaunchCounter, torch.Tensor]:
    """Count one eager decode step of ``engine`` (:meth:`kvchat.engine.runner.Engine.decode` of the last id
    of ``token_ids``, all earlier ones in the pool; CUDA graphs off for it, whose replay is one launch).

    Returns:
        ``(counter, logits)``: the :class:`LaunchCounter` over the model's layers and the step's float32
        logits ``[vocab_size]``.
    """
    graphs = engine.decode_graphs
    enabled = graphs is not None and graphs.enabled
    if graphs is not None:
        graphs.enabled = False
    try:
        with LaunchCounter(engine.model.layers) as counter:
            logits = engine.decode(seq, token_ids)
    finally:
        if graphs is not None:
            graphs.enabled = enabled
    return counter, logits
