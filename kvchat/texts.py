"""Real English text that ships with every Python: docstrings of standard-library modules.

The fp8 K-centring calibration (:mod:`kvchat.engine.calibration`, run by
:func:`kvchat.runtime.ensure_calibration`) and the benchmarks need prose the
project did not write and that exists on any machine with kvchat installed
(the seed articles are not shipped). The docstrings of pure-Python
standard-library modules are read from their source with :mod:`ast` (so
``python -OO`` does not strip them) and joined in a fixed order. The text
depends on the Python version; its sha256 is reported next to every figure
made from it.

Two disjoint module sets: ``EVAL_MODULES`` for prompts and evaluation,
``CALIBRATION_MODULES`` for calibrating quantization schemes, so a scheme is
never calibrated on the text it is evaluated on.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
from dataclasses import dataclass

EVAL_MODULES = (
    "argparse", "subprocess", "logging", "pathlib", "dataclasses", "functools", "textwrap",
    "difflib", "shutil", "tarfile", "zipfile", "threading", "inspect", "typing", "json",
)
CALIBRATION_MODULES = (
    "collections", "contextlib", "email.message", "http.client", "unittest.case", "pprint",
    "tempfile", "configparser", "smtplib", "string", "random", "statistics", "calendar",
)


class TextSourceError(RuntimeError):
    """The standard library's sources are not available (e.g. a frozen or zipped install)."""


@dataclass(slots=True, frozen=True)
class BenchText:
    """A named text: ``name`` says where it came from, ``sha256`` identifies its bytes (hex)."""

    name: str
    text: str
    sha256: str


def _docstrings(module: str) -> list[str]:
    """Module, class and function docstrings of ``module``'s source, in source order."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise TextSourceError(f"no Python source for standard-library module {module!r}")
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)))]
    nodes.sort(key=lambda n: getattr(n, "lineno", 0))
    return [d for n in nodes if (d := ast.get_docstring(n, clean=True)) and len(d.split()) >= 8]


def stdlib_text(modules: tuple[str, ...] = EVAL_MODULES) -> BenchText:
    """Docstrings (at least 8 words each) of ``modules``, joined by blank lines.

    Returns:
        :class:`BenchText` named ``"python-stdlib-docstrings:<first>..<last>"``;
        about 54k SmolLM2 tokens for :data:`EVAL_MODULES` on Python 3.11.
    Raises:
        TextSourceError: a module has no ``.py`` source.
    """
    text = "\n\n".join(d for m in modules for d in _docstrings(m))
    digest = hashlib.sha256(text.encode()).hexdigest()
    return BenchText(f"python-stdlib-docstrings:{modules[0]}..{modules[-1]}", text, digest)
