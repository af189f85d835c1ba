"""Where and when a benchmark ran: machine, date, git commit, package versions.

Every benchmark JSON carries :func:`run_info` under the key ``"run"``, so a
figure can always be traced to the CPU, thread count, code and libraries
that produced it. Nothing here imports torch unless it is already imported.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

PACKAGES = ("kvchat", "torch", "transformers", "tokenizers", "safetensors", "numpy", "triton",
            "matplotlib", "llama_cpp_python", "llguidance")


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (Linux), else :func:`platform.processor`."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask), falling back to ``os.cpu_count()``."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def git_commit(repo: Path | None = None) -> dict:
    """``{"commit": sha or None, "dirty": bool or None}`` of the checkout kvchat runs from.

    ``None`` values when kvchat is not running from a git checkout (an
    installed wheel) or git is missing.
    """
    repo = repo or Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": sha or None, "dirty": bool(status.strip())}


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    """Installed version of each distribution in ``names`` (None: not installed)."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def threads_in_use() -> int | None:
    """torch's intra-op thread count if torch is imported in this process, else None."""
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else None


def peak_rss_bytes() -> int | None:
    """This process's peak resident set since it started (or since ``/proc/self/clear_refs`` was given ``5``), in
    bytes: ``VmHWM`` of ``/proc/self/status`` (Linux; None elsewhere). Not ``getrusage``'s ``ru_maxrss``, which
    Linux carries over an ``exec``: a child spawned by a large process would report its parent's size."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def run_info(*, threads: int | None = None, quick: bool = False) -> dict:
    """The metadata block of a benchmark JSON.

    Args:
        threads: CPU threads the measured work used (None: read from torch in
            this process, when imported).
        quick: the run used ``--quick`` settings (smaller lengths and repeats;
            figures are for checking the plumbing, not for quoting).
    Returns:
        ``{"date_utc", "quick", "machine": {cpu_model, cores, usable_cores,
        threads, platform, python}, "git": {commit, dirty}, "packages": {...}}``.
    """
    return {
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "quick": quick,
        "machine": {
            "cpu_model": cpu_model(),
            "cores": os.cpu_count(),
            "usable_cores": usable_cores(),
            "threads": threads if threads is not None else threads_in_use(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        },
        "git": git_commit(),
        "packages": package_versions(),
    }


def write_json(path: str | Path, result: dict) -> None:
    """Write a benchmark result as indented UTF-8 JSON with a final newline.

    Raises:
        OSError: ``path`` cannot be written.
    """
    import json

    Path(path).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


def print_report(result: dict, text: str, json_path: str | Path | None) -> int:
    """A ``kvchat bench`` command's ending: print its tables ``text``, write ``result`` to ``json_path`` when one
    is given (:func:`write_json`). Returns 0, the command's exit status.

    Raises:
        OSError: ``json_path`` cannot be written.
    """
    print(text)
    if json_path:
        write_json(json_path, result)
    return 0
