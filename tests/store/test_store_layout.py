"""The store's boundary, read from the source (nothing is imported): SQL lives only in ``store/``,
and ``store/`` imports nothing of kvchat outside ``kvchat.store`` (callers pass it every path).

``kvchat/bench`` is exempt from the SQL rule: its crash checks open a copy of a data dir with plain
``sqlite3`` on purpose, to judge the store from outside.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SQL = re.compile(
    r"\bSELECT\b[\s\S]*\bFROM\b|\bINSERT\s+(?:OR\s+[A-Z]+\s+)?INTO\b|\bUPDATE\s+\S+\s+SET\b|\bDELETE\s+FROM\b"
    r"|\bCREATE\s+(?:VIRTUAL\s+)?TABLE\b|\bPRAGMA\s+\w+"
)


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of docstring nodes (prose may name ``PRAGMA quick_check``; it runs nothing)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def sql_literals(path: Path) -> list[tuple[int, str]]:
    """``(line, text)`` of each string literal in ``path`` that reads as an SQL statement.

    An f-string counts with its placeholders as ``{}`` (``f"UPDATE {table} SET …"`` is caught);
    implicitly concatenated literals are one constant, so a statement split over lines is whole.
    """
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    docs = _docstrings(tree)
    parts_of_fstrings = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) in docs or id(node) in parts_of_fstrings:
                continue
            text = node.value
        else:
            continue
        if SQL.search(text):
            found.append((node.lineno, " ".join(text.split())[:80]))
    return found


def test_sql_only_in_store():
    hits = []
    for path in sorted((ROOT / "kvchat").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("kvchat/bench/"):
            continue
        hits += [f"{rel}:{line}: {text}" for line, text in sql_literals(path)]
    assert not hits, "SQL outside store/ (add a function to the table's store module and call it):\n" + "\n".join(hits)


def test_sql_scanner_sees_statements(tmp_path):
    code = ('x = "SELECT a FROM t"\ny = f"UPDATE {t} SET pinned = ?"\n'
            'z = ("DELETE FROM chunk_refs"\n     " WHERE owner = ?")\ndef f():\n    """PRAGMA quick_check in prose."""\n'
            'w = "select a from t is prose"\n')
    probe = tmp_path / "probe.py"
    probe.write_text(code)
    assert [line for line, _ in sql_literals(probe)] == [1, 2, 3]


def _imported_modules(path: Path, module: str) -> list[tuple[int, str]]:
    """``(line, absolute module)`` of every import in ``path`` (module ``module``), relative ones resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - (node.level - 1)] + ([base] if base else []))
            out.append((node.lineno, base))
    return out


def test_store_imports_nothing_of_kvchat_outside_store():
    bad = []
    for path in sorted((ROOT / "store").rglob("*.py")):
        parts = [p for p in path.relative_to(ROOT / "store").with_suffix("").parts if p != "__init__"]
        module = ".".join(["kvchat", "store", *parts])
        for line, name in _imported_modules(path, module):
            top = name.split(".")[:2]
            if top[0] == "kvchat" and top != ["kvchat", "store"]:
                bad.append(f"store/{path.relative_to(ROOT / 'store').as_posix()}:{line}: imports {name}")
    assert not bad, "store/ must take paths and settings from its callers:\n" + "\n".join(bad)
