"""The import graph of kvchat/, kernels/ and store/, from the source (no module is imported).

Three rules: no import cycles between modules, nor between packages (``kvchat.engine``, ``kvchat.model``,
… each with its subpackages; a top-level module of ``kvchat`` stands alone), where imports under
``if TYPE_CHECKING:`` do not count and imports inside functions do; and nothing below the command line imports it:
only ``kvchat.bench`` and the ``kvchat/cli*`` modules may import ``kvchat.bench``
or ``kvchat.cli``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"kvchat": "kvchat", "kvchat.kernels": "kernels", "kvchat.store": "store"}  # as pyproject's package-dir
COMMAND_LINE = ("kvchat.bench", "kvchat.cli")


def module_files(root: Path, packages: dict[str, str]) -> dict[str, Path]:
    """Dotted module name -> source file, for every ``*.py`` under each package's directory."""
    mods: dict[str, tuple[str, Path]] = {}
    for pkg, d in packages.items():
        for f in sorted((root / d).rglob("*.py")):
            parts = [p for p in f.relative_to(root / d).with_suffix("").parts if p != "__init__"]
            name = ".".join([pkg, *parts])
            if name not in mods or len(pkg) > len(mods[name][0]):  # the more specific mapping wins
                mods[name] = (pkg, f)
    return {name: f for name, (_, f) in mods.items()}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for sub in node.body for n in ast.walk(sub))
    return skip


def import_edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of ``mods`` it imports (``from a import b`` counts ``a.b`` if that is a module)."""

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        tree = ast.parse(f.read_text(encoding="utf-8"), str(f))
        skip = _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = m.split(".") if f.name == "__init__.py" else m.split(".")[:-1]
                    base = ".".join(here[: len(here) - (node.level - 1)] + ([node.module] if node.module else []))
                targets = [base, *(f"{base}.{a.name}" for a in node.names)]
            else:
                continue
            edges[m].update(r for t in targets if (r := resolve(t)) and r != m)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of two or more modules (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def package_edges(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """``edges`` between packages: each module counts as its first-level package below ``kvchat``
    (``kvchat.tui.screens.chat`` -> ``kvchat.tui``); a top-level module of ``kvchat`` as itself."""
    packages = sorted({m for m in edges if m != "kvchat" and any(o.startswith(m + ".") for o in edges)}, key=len)

    def package(module: str) -> str:
        return next((p for p in packages if _is_under(module, p)), module)

    out: dict[str, set[str]] = {package(m): set() for m in edges}
    for m, targets in edges.items():
        out[package(m)].update(package(t) for t in targets if package(t) != package(m))
    return out


def _is_under(module: str, top: str) -> bool:
    return module == top or module.startswith(top + ".")


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    """``importer -> imported`` for each module outside the command line that imports ``kvchat.bench`` or ``kvchat.cli``."""
    allowed = [m for m in edges if _is_under(m, "kvchat.bench") or m.startswith("kvchat.cli")]
    return sorted(f"{m} -> {t}" for m, ts in edges.items() if m not in allowed
                  for t in ts if any(_is_under(t, top) for top in COMMAND_LINE))


def test_no_import_cycles():
    found = cycles(import_edges(module_files(ROOT, PACKAGES)))
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_package_import_cycles():
    found = cycles(package_edges(import_edges(module_files(ROOT, PACKAGES))))
    assert not found, "package import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_runtime_modules_do_not_import_the_command_line():
    found = upward_imports(import_edges(module_files(ROOT, PACKAGES)))
    assert not found, "runtime modules importing kvchat.bench / kvchat.cli: " + "; ".join(found)


def test_the_checks_see_cycles_and_upward_imports(tmp_path):
    """On a made-up package: a function-level cycle counts, a TYPE_CHECKING one does not."""
    pkg = tmp_path / "kvchat"
    (pkg / "bench").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from kvchat import b\n",
        "b.py": "def f():\n    from . import a\n",
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvchat import d\n",
        "d.py": "import kvchat.c\nfrom kvchat.bench.x import y\n",
        "cli.py": "from kvchat.bench import x\n",
        "bench/__init__.py": "",
        "bench/x.py": "y = 1\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    edges = import_edges(module_files(tmp_path, {"kvchat": "kvchat"}))
    assert cycles(edges) == [["kvchat.a", "kvchat.b"]]
    assert upward_imports(edges) == ["kvchat.d -> kvchat.bench.x"]


def test_the_package_check_sees_a_cycle_no_module_cycle_shows(tmp_path):
    """On a made-up package: ``p.a -> q.b`` and ``q.c -> p.d`` make no module cycle but a package one; a
    subpackage counts as its package, a top-level module as itself."""
    pkg = tmp_path / "kvchat"
    files = {
        "__init__.py": "",
        "top.py": "from kvchat.p import d\n",
        "p/__init__.py": "",
        "p/a.py": "from kvchat.q import b\n",
        "p/d.py": "",
        "q/__init__.py": "",
        "q/b.py": "",
        "q/sub/__init__.py": "",
        "q/sub/c.py": "from kvchat.p import d\n",
    }
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    edges = import_edges(module_files(tmp_path, {"kvchat": "kvchat"}))
    assert cycles(edges) == []
    packages = package_edges(edges)
    assert packages["kvchat.top"] == {"kvchat.p"} and "kvchat.q.sub" not in packages
    assert cycles(packages) == [["kvchat.p", "kvchat.q"]]


def test_the_server_reaches_the_store_only_through_the_conversation_layer():
    """``kvchat.server`` translates HTTP to the conversation service: none of its modules imports ``kvchat.store``."""
    edges = import_edges(module_files(ROOT, PACKAGES))
    server = [m for m in edges if _is_under(m, "kvchat.server")]
    assert "kvchat.server.scheduler" in server
    found = sorted(f"{m} -> {t}" for m in server for t in edges[m] if _is_under(t, "kvchat.store"))
    assert not found, "server modules importing the store: " + "; ".join(found)
