"""``torch.inference_mode`` is entered in two places of the runtime: the engine loop, which holds it for every
turn, and :func:`kvchat.engine.inference.inference`, which everything else calls (the engine's calls made by
hand, its load, a restore's reader threads, the benchmarks). Read from the source."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OWNERS = {"kvchat/engine/loop.py", "kvchat/engine/inference.py"}


def _entered(tree: ast.AST) -> list[int]:
    """Lines that call ``torch.inference_mode()`` turned on (``inference_mode(False)`` leaves it)."""
    lines = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "inference_mode"
                and not (node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value is False)):
            lines.append(node.lineno)
    return lines


def test_only_the_loop_and_the_one_helper_enter_inference_mode():
    found = {}
    for top in ("kvchat", "kernels", "store"):  # the benchmarks (kvchat/bench) included
        for f in sorted((ROOT / top).rglob("*.py")):
            rel = f.relative_to(ROOT).as_posix()
            if lines := _entered(ast.parse(f.read_text(encoding="utf-8"))):
                found[rel] = lines
    assert set(found) == OWNERS, found


def test_the_check_sees_a_call_and_a_decorator_and_passes_over_turning_it_off():
    src = "import torch\n@torch.inference_mode()\ndef f():\n    with torch.inference_mode(False):\n        pass\n"
    assert _entered(ast.parse(src)) == [2]
