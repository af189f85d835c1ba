"""How one engine runs, decided once when it loads: :class:`ExecutionPlan` and the rules that make it
(:func:`plan_execution`).

The engine (:class:`kvchat.engine.runner.Engine`) builds what the plan names (the dense K/V copy, the compiled
decoder layers, the CUDA graphs) and its forwards read the plan; none of them reads a setting or decides again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvchat.engine.decode_graphs import graphs_wanted
from kvchat.kernels import cpu_attention
from kvchat.kernels.dispatch import KernelChoice
from kvchat.kernels.layout import KVLayer


@dataclass(frozen=True, slots=True)
class ExecutionPlan:
    """How one engine runs, decided once when it loads (:class:`Engine`) and read by its forwards; no forward
    reads a setting.

    Attributes:
        device: the torch device, e.g. ``cpu`` or ``cuda:0``.
        weight_format: a :data:`kvchat.engine.cache_identity.WEIGHT_FORMATS` name.
        compute_dtype: the activations' dtype name, e.g. ``float32``.
        attention: the kernels' backend, ``triton`` | ``compiled`` | ``torch``
            (:class:`kvchat.kernels.dispatch.KernelChoice`).
        dense_kv: prefill chunks read a contiguous copy of the K/V (:class:`DenseKV`, the CPU read path).
        decode_on_pool: decode steps read the paged pool (GPUs, and CPUs with the compiled kernels), else
            the dense copy.
        compiled_layers: a CPU decode step's or short chunk's layers run compiled, one call each
            (:mod:`kvchat.model.compiled_decode`).
        pad_decode: decode batches are padded to :data:`BATCH_BUCKETS` (where CUDA graphs can run).
        cuda_graphs: decode steps replay CUDA graphs (:mod:`kvchat.engine.decode_graphs`).
        int8_kernel: the int8 matmul kernel's name (None: no int8 weights).
        int8_prefill: int8 layers' prefill chunks run int8 activations on the integer kernel
            (:func:`kvchat.engine.cache_identity.int8_prefill_enabled`), else the fp32 GEMM.
        exact_sink: position 0 is read exact (:meth:`Engine.sink_kv`).
    """

    device: str
    weight_format: str
    compute_dtype: str
    attention: str
    dense_kv: bool
    decode_on_pool: bool
    compiled_layers: bool
    pad_decode: bool
    cuda_graphs: bool
    int8_kernel: str | None
    exact_sink: bool
    int8_prefill: bool = False

    def line(self) -> str:
        """The plan in one line, e.g. ``cpu, int8 weights (avx2), float32, attention compiled, decode on the
        pool, compiled layers, exact sink``."""
        parts = [self.device, f"{self.weight_format} weights" + (f" ({self.int8_kernel})" if self.int8_kernel else ""),
                 self.compute_dtype, f"attention {self.attention}",
                 "decode on the pool" if self.decode_on_pool else "decode on the dense copy"]
        parts += [name for on, name in ((self.dense_kv, "dense prefill copy"), (self.compiled_layers, "compiled layers"),
                                        (self.pad_decode, "padded decode batches"), (self.cuda_graphs, "CUDA graphs"),
                                        (self.exact_sink, "exact sink"),
                                        (self.int8_prefill, "int8 prefill activations")) if on]
        return ", ".join(parts)


def plan_execution(device: torch.device, kernels: KernelChoice, pool_layer: KVLayer, *, weight_format: str,
                   compute_dtype: torch.dtype, int8_kernel: str | None, exact_sink: bool, int8_prefill: bool,
                   dense_kv: bool | None, compiled_layers_fit: bool, cuda_graphs: bool) -> ExecutionPlan:
    """The plan of an engine on ``device`` whose model runs ``kernels`` over a pool whose first layer is
    ``pool_layer`` (:meth:`kvchat.engine.kv_pool.KVPool.layer`).

    The rules, each in one place:

    - the dense K/V copy (``dense_kv``; None: decided here) on a CPU without the Triton kernels: torch's
      attention and the compiled chunk attention read contiguous K/V faster than gathering blocks;
    - decode on the pool without the dense copy, and with it where the compiled CPU attention reads this pool
      (:func:`kvchat.kernels.cpu_attention.takes_pool`);
    - the compiled decoder layers with the ``compiled`` backend when decode is on the pool and the model and
      pool fit them (``compiled_layers_fit``: :func:`kvchat.model.compiled_decode.compiled_decode` built them);
    - decode batches padded to the warmed-up batch sizes without the dense copy where CUDA graphs could run
      (:func:`kvchat.engine.decode_graphs.graphs_wanted`, with graphs off too), and graphs replayed there when
      ``cuda_graphs`` (``KVCHAT_CUDA_GRAPHS``).

    ``weight_format``, ``compute_dtype``, ``int8_kernel``, ``exact_sink`` and ``int8_prefill`` were decided
    while loading (they shape the weights and the pool) and are recorded as given.
    """
    backend = kernels.backend
    if dense_kv is None:
        dense_kv = device.type == "cpu" and backend != "triton"
    decode_on_pool = not dense_kv or (backend == "compiled" and cpu_attention.takes_pool(pool_layer))
    compiled_layers = backend == "compiled" and decode_on_pool and compiled_layers_fit
    pad_decode = not dense_kv and graphs_wanted(device, backend, True)
    return ExecutionPlan(str(device), weight_format, str(compute_dtype).removeprefix("torch."), backend, dense_kv,
                         decode_on_pool, compiled_layers, pad_decode, pad_decode and cuda_graphs, int8_kernel,
                         exact_sink, int8_prefill)
