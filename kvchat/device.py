"""The engine's device: checked once at start, made current for every launch.

Triton kernels (and any op that allocates without an explicit device) use the
*current* CUDA device, which is ``cuda:0`` unless set. An engine on
``cuda:1`` therefore makes its device current at start
(``torch.cuda.set_device``) and runs each forward under
``torch.cuda.device(...)`` (:func:`device_guard`), so a second engine or a
library that changes the current device cannot send its launches elsewhere.
"""

from __future__ import annotations

import contextlib

import torch


class DeviceError(ValueError):
    """A device that does not exist here; the message is one line."""


def check_device(device: torch.device | str) -> torch.device:
    """``device`` as a ``torch.device`` after checking it exists; ``cuda`` becomes ``cuda:<current>``.

    Raises:
        DeviceError: ``cuda`` where this torch has no CUDA or sees no GPU; ``cuda:N`` beyond the
            devices torch sees; a device type other than cpu/cuda.
    """
    dev = torch.device(device)
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise DeviceError(f"device {str(dev)!r} is not supported; use cpu, cuda or cuda:N")
    if torch.version.cuda is None:
        raise DeviceError(f"device {str(dev)!r}: this torch ({torch.__version__}) is built without CUDA")
    count = torch.cuda.device_count()
    if count == 0:
        raise DeviceError(f"device {str(dev)!r}: torch sees no CUDA device")
    if dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if dev.index >= count:
        raise DeviceError(f"device {str(dev)!r}: torch sees {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return dev


def activate(device: torch.device) -> None:
    """Make a (checked) CUDA ``device`` the current one; nothing on CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def device_guard(device: torch.device):
    """A context manager making ``device`` current for its body (a no-op context on CPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def release_pinned_cache() -> None:
    """Give the pinned (page-locked) host blocks torch's host caching allocator keeps after their tensors
    are freed back to the OS: freeing a pinned tensor only returns it to that cache, where it stays locked
    out of the rest of the machine. Call only after CUDA was used; a no-op on torch < 2.9, which has no
    ``torch.accelerator.empty_host_cache`` (the blocks then stay cached, reused by later pinned allocations)."""
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    if empty is not None:
        empty()
