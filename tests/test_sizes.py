"""Sizes a reader can take in one sitting (the layers issue): no module over 500 lines, no
class over 300, no function over 60, anywhere in the package but generated gRPC code.
A part that outgrows them is split along a seam, not squeezed."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "kvxfer"
LIMITS = {"module": 500, "class": 300, "function": 60}


def sizes(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[tuple[str, str, int]]:
    """(kind, name, lines) of the module and every class and function in it."""
    src = path.read_text()
    where = str(path.relative_to(root.parent))
    out = [("module", where, src.count("\n"))]
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            assert node.end_lineno is not None
            out.append((kind, f"{where}:{node.name}", node.end_lineno - node.lineno + 1))
    return out


def test_nothing_in_the_package_outgrows_its_limit() -> None:
    over = [f"{kind} {name}: {n} lines (limit {LIMITS[kind]})"
            for path in sorted(ROOT.rglob("*.py")) if "_pb2" not in path.name
            for kind, name, n in sizes(path) if n > LIMITS[kind]]
    assert not over, "\n".join(over)


def test_the_measure_sees_classes_functions_and_modules(tmp_path: pathlib.Path) -> None:
    src = tmp_path / "kvxfer" / "m.py"
    src.parent.mkdir()
    src.write_text("class A:\n    def f(self):\n        pass\n\n\nasync def g():\n    pass\n")
    got = {(kind, name): n for kind, name, n in sizes(src, tmp_path / "kvxfer")}
    assert got == {("module", "kvxfer/m.py"): 7, ("class", "kvxfer/m.py:A"): 3,
                   ("function", "kvxfer/m.py:f"): 2, ("function", "kvxfer/m.py:g"): 2}
