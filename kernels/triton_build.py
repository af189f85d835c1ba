"""Whether Triton can build its host-side launcher here, and recognising the error when it cannot.

On a GPU, Triton's first launch of a kernel compiles a small C launcher (and its CUDA driver stubs) with
the host's C compiler against Python's headers (``triton.runtime.build``: ``$CC``, else ``gcc`` or
``clang`` on ``PATH``, and ``Python.h``). Without them the launch raises deep inside Triton, which at an
engine's start is its kernel warm-up: a traceback where the PyTorch reference kernels would have run.
:func:`launcher_problem` checks the same things first, so the dispatch can take the reference path with
one line; :func:`is_build_failure` recognises what Triton raises when a build fails all the same (a
broken compiler, a header missing deeper down), for the warm-up to fall back alike.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

FIX = "install gcc and the Python headers (python3-dev) or set CC"


def launcher_problem() -> str | None:
    """Why Triton could not build its launcher here (one line, without the remedy), or None.

    Checks what ``triton.runtime.build`` uses: ``$CC`` when set (it must resolve to a program), else
    ``gcc`` or ``clang`` on ``PATH``; and ``Python.h`` in this interpreter's include dir.
    """
    cc = os.environ.get("CC")
    if cc is not None:
        if shutil.which(cc) is None:
            return f"the C compiler CC={cc} does not exist"
    elif shutil.which("gcc") is None and shutil.which("clang") is None:
        return "there is no C compiler (gcc or clang on PATH, or CC)"
    include = Path(sysconfig.get_paths()["include"])
    if not (include / "Python.h").is_file():
        return f"the Python headers are missing ({include / 'Python.h'})"
    return None


def is_build_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is Triton failing to build a host module: the compiler exited with an error, could
    not be started, or was not found (``triton.runtime.build``'s RuntimeError: "Failed to find C compiler").
    Other errors (a missing file of the model, a kernel's own bug) are not, so they never switch Triton off."""
    if isinstance(exc, subprocess.CalledProcessError):
        return True
    if isinstance(exc, FileNotFoundError):  # the compiler itself could not be started
        compilers = {"gcc", "clang", "cc", Path(os.environ.get("CC") or "cc").name}
        return Path(str(exc.filename or "")).name in compilers
    return isinstance(exc, RuntimeError) and "failed to find c compiler" in str(exc).lower()
