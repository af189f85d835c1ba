"""Compile the Triton kernels at engine start for every variant a chat will launch (no compile stall mid-chat).

Triton compiles one binary per *specialization* of a kernel: its constexpr
arguments (for decode ``DIRECT_OUT = num_splits == 1`` and the merge's
``BLOCK_S = next_pow2(num_splits)``) plus, for every plain integer
argument, whether it equals 1 (then a compile-time constant) or is a
multiple of 16 (marked divisible), as ``triton.runtime.jit`` specializes
them. During a chat the integers that vary are the block table's width (its
row stride: one column per block, growing with the sequence) and the decode
split count of the launch grid (:func:`kvchat.kernels.triton_decode.splits_for`
at the table's capacity, which grows with the width until about one program
per SM exists). Everything else (head counts, head_dim, pool strides, dtypes,
the sink, the split kernel's ``split_tokens``) is fixed per engine.

:func:`plan_warmup` lists one launch per variant those widths and split
counts reach up to the engine's context limit; :func:`launch_warmup` runs
them on all-zero inputs (sequence lengths 0 and empty chunks, so nothing is
read or written beyond the outputs); :func:`warm_up` is the engine's one
call, a no-op unless the pool is on a GPU and the Triton backend serves it.
Where Triton fails to build its host launcher there (:func:`compile_plan`),
the warm-up says so in one line and the engine runs the PyTorch reference.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from kvchat.kernels import dispatch
from kvchat.kernels.layout import KVLayer
from kvchat.kernels.triton_build import is_build_failure

DECODE_BATCHES = (1,)  # decode batch sizes an engine runs (the batching server passes its buckets)
_log = logging.getLogger(__name__)


def int_class(n: int) -> str:
    """How Triton specializes an integer argument: ``"1"`` (a constant), ``"D"`` (multiple of 16), ``""``."""
    return "1" if n == 1 else "D" if n % 16 == 0 else ""


@dataclass(frozen=True, slots=True)
class DecodeLaunch:
    """One decode launch: ``num_seqs`` queries, a block table ``width`` columns wide, ``num_splits`` splits;
    ``row_stride``: the table's row stride (0: ``width``, a table of its own; the engine's persistent
    table, ``kvchat.engine.decode_buffers``, is read through views of its full width)."""

    num_seqs: int
    width: int
    num_splits: int
    row_stride: int = 0

    @property
    def variant(self) -> tuple[str, int, str]:
        """What selects the compiled binaries (split kernel and merge): split-count class, merge
        ``BLOCK_S`` (0: no merge, a single split), block-table-width class."""
        from .triton_decode import merge_block

        merge = merge_block(self.num_splits) if self.num_splits > 1 else 0
        return int_class(self.num_splits), merge, int_class(self.row_stride or self.width)


@dataclass(frozen=True, slots=True)
class ExtendLaunch:
    """One extend (prefill chunk) launch with a block table ``width`` columns wide."""

    width: int

    @property
    def variant(self) -> str:
        """The block-table-width class, the only launch integer that varies."""
        return int_class(self.width)


def plan_warmup(num_kv_heads: int, block_size: int, max_context: int, num_sms: int,
                batch_sizes: Sequence[int] = DECODE_BATCHES, decode_widths: Sequence[int] | None = None,
                row_stride: int = 0) -> list[DecodeLaunch | ExtendLaunch]:
    """One launch per kernel variant that sequences of 1 .. ``max_context`` tokens reach.

    Args:
        num_kv_heads, block_size: the pool's.
        max_context: longest sequence in tokens (the engine's context limit).
        num_sms: the GPU's SM count (sets the split counts, see ``triton_decode.splits_for``).
        batch_sizes: numbers of sequences decoded together.
        decode_widths, row_stride: the only block-table widths decode launches with (the engine's context
            buckets) and the row stride they are read with; None: every width, each a table of its own.
    Returns:
        Decode launches (the first width reaching each variant, per variant) then extend launches.
    """
    from .triton_decode import splits_for

    max_width = -(-max_context // block_size)
    decode: dict[tuple, DecodeLaunch] = {}
    extend: dict[str, ExtendLaunch] = {}
    for width in range(1, max_width + 1):
        extend.setdefault(ExtendLaunch(width).variant, ExtendLaunch(width))
        if decode_widths is not None and width not in decode_widths:
            continue
        for b in batch_sizes:
            launch = DecodeLaunch(b, width, splits_for(b, num_kv_heads, width * block_size, num_sms), row_stride)
            decode.setdefault(launch.variant, launch)
    return [*decode.values(), *extend.values()]


def launch_warmup(plan: Sequence[DecodeLaunch | ExtendLaunch], layer: KVLayer, num_heads: int, dtype: torch.dtype,
                  exact_sink: bool, progress: Callable[[int, int], None] | None = None) -> None:
    """Launch every planned variant of decode and extend (and the cache write once) on zero inputs.

    Args:
        layer: one layer of the engine's pool.
        num_heads: query heads; dtype: the activations' dtype (the engine's compute dtype).
        exact_sink: pass a float32 sink, as the engine's attention calls do.
        progress: called with ``(launches done, len(plan))`` after each one (a first start compiles each).

    Queries are views into ``[T, num_heads + num_kv_heads, head_dim]`` rows, the
    layout the model hands the kernels (q is the front of the rotated q/k rows),
    so their strides specialize alike. Lengths are 0 and chunks empty: the
    kernels write zero outputs and read no K/V.
    """
    from .triton_decode import MIN_TOKENS_PER_SPLIT, paged_decode
    from .triton_extend import extend_attention
    from .triton_write import write_kv

    device = layer.k_cache.device
    _, block_size, num_kv_heads, head_dim = layer.k_cache.shape

    def queries(n: int) -> torch.Tensor:
        return torch.zeros(n, num_heads + num_kv_heads, head_dim, dtype=dtype, device=device)[:, :num_heads]

    def sink(n: int):
        return tuple(torch.zeros(n, num_kv_heads, head_dim, device=device) for _ in range(2)) if exact_sink else None

    def table(n: int, width: int, stride: int = 0) -> tuple[torch.Tensor, torch.Tensor]:  # lengths 0
        return (torch.zeros(n, stride or width, dtype=torch.int32, device=device)[:, :width],
                torch.zeros(n, dtype=torch.int32, device=device))

    kv = torch.zeros(1, num_kv_heads, head_dim, dtype=dtype, device=device)
    write_kv(kv, kv, layer, torch.full((1,), -1, dtype=torch.long, device=device))
    for done, launch in enumerate(plan, 1):
        if isinstance(launch, DecodeLaunch):
            n = launch.num_seqs
            paged_decode(queries(n), layer, *table(n, launch.width, launch.row_stride), head_dim**-0.5,
                         sink(n), num_splits=launch.num_splits, split_tokens=MIN_TOKENS_PER_SPLIT)  # as engines
        else:
            extend_attention(queries(1), layer, *table(1, launch.width),
                             torch.zeros(2, dtype=torch.int32, device=device), head_dim**-0.5, sink(1))
        if progress is not None:
            progress(done, len(plan))


def compile_plan(plan: Sequence[DecodeLaunch | ExtendLaunch], layer: KVLayer, num_heads: int, dtype: torch.dtype,
                 exact_sink: bool, progress: Callable[[int, int], None] | None = None) -> bool:
    """:func:`launch_warmup` on ``layer`` (a CUDA pool's, or under the interpreter a CPU one), synced.

    Returns False when Triton failed to build its host launcher (no usable C compiler or Python headers,
    :func:`kvchat.kernels.triton_build.is_build_failure`): the dispatch then sends CUDA tensors to the
    PyTorch reference (:func:`kvchat.kernels.dispatch.disable_triton`, which names the failure in one
    logged line) instead of a traceback. Any other error propagates.
    """
    cuda = layer.k_cache.is_cuda
    try:
        with torch.cuda.device(layer.k_cache.device) if cuda else contextlib.nullcontext():
            launch_warmup(plan, layer, num_heads, dtype, exact_sink, progress)
            if cuda:
                torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - only a failed launcher build is recovered from, below
        if not is_build_failure(exc):
            raise
        dispatch.disable_triton(" ".join(f"{type(exc).__name__}: {exc}".split())[:300])
        return False
    return True


def warm_up(layer: KVLayer, num_heads: int, dtype: torch.dtype, max_context: int, exact_sink: bool,
            batch_sizes: Sequence[int] = DECODE_BATCHES, decode_widths: Sequence[int] | None = None,
            row_stride: int = 0, progress: Callable[[int, int], None] | None = None) -> list[DecodeLaunch | ExtendLaunch]:
    """Compile every kernel variant an engine will launch, at its start; the launches made.

    A no-op (``[]``) unless ``layer`` (one layer of the engine's pool) is on a CUDA device and
    the Triton backend serves it; ``[]`` too when Triton cannot build its launcher there (:func:`compile_plan`: the engine then runs the
    reference). On a GPU the first start compiles (about 20 variants; ``progress`` gets
    ``(done, total)`` after each); later starts find Triton's on-disk cache. See
    :func:`plan_warmup` for the other arguments.
    """
    k_cache = layer.k_cache
    if not k_cache.is_cuda or dispatch.backend_for(k_cache) != "triton":
        return []
    from .triton_decode import num_sms

    t0 = time.perf_counter()
    plan = plan_warmup(k_cache.shape[2], k_cache.shape[1], max_context, num_sms(k_cache.device), batch_sizes,
                       decode_widths, row_stride)
    if not compile_plan(plan, layer, num_heads, dtype, exact_sink, progress):
        return []
    _log.info("kvchat: %d Triton kernel variants ready in %.1f s", len(plan), time.perf_counter() - t0)
    return plan
