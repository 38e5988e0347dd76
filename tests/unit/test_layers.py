"""The package's layers hold, as docs/design.md draws them.

The floors are read from the page's layer block (top floor first; units on one line sit side
by side), so the page and the code cannot drift. Over every module of the package and the
benchmarks, imports inside functions included:

- a module imports only its own unit (top-level folder, or root file) or units on lower floors;
- no import cycle, between units or inside one;
- only ``_compat/`` touches torch's private modules (``torch._*``).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
PACKAGE = "bucketwise"


def floors() -> dict[str, int]:
    """Unit (``compiler/``, ``hf.py``, ...) -> floor, 0 the lowest, from docs/design.md."""
    block = re.search(r"<!-- layers:begin -->\n```\n(.*?)```\n<!-- layers:end -->", DESIGN.read_text(), re.S)
    assert block, "docs/design.md has no layer block between <!-- layers:begin --> and <!-- layers:end -->"
    lines = [line.split("#")[0].split() for line in block.group(1).splitlines()]
    lines = [units for units in lines if units]
    return {unit: len(lines) - 1 - i for i, units in enumerate(lines) for unit in units}


def unit_of(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0] + "/" if len(rel.parts) > 1 else rel.name


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join([PACKAGE, *parts])


def package_modules() -> dict[str, Path]:
    units = floors()
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if "results" in rel.parts or rel.parts[0] in ("tests", "docs") or rel.parts[0].startswith("."):
            continue
        assert unit_of(path) in units, f"{rel} belongs to no floor of docs/design.md's layer block: add its unit there"
        out[module_name(path)] = path
    return out


def imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The package modules ``path`` imports (anywhere in it), resolved to module names."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            # ``from X import y``: the submodule X.y where there is one, else X itself.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for t in targets:
            while t and t not in modules and "." in t:
                t = t.rsplit(".", 1)[0]
            if t in modules and t != name:
                out.add(t)
    return out


def private_torch(path: Path) -> list[str]:
    """Where ``path`` reaches a private torch module: ``torch._x`` in code or in an import."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and isinstance(node.value, ast.Name)
            and node.value.id == "torch"
        ):
            found.append(f"line {node.lineno}: torch.{node.attr}")
        if isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names if a.name.startswith("torch._")]
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch._"):
            found.append(f"line {node.lineno}: from {node.module} import ...")
    return found


@pytest.fixture(scope="module")
def graph() -> tuple[dict[str, Path], dict[str, set[str]]]:
    modules = package_modules()
    return modules, {name: imports(path, name, modules) for name, path in modules.items()}


def test_modules_import_only_their_floor_and_below(graph):
    modules, edges = graph
    level = floors()
    wrong = []
    for name, targets in edges.items():
        mine = unit_of(modules[name])
        for t in targets:
            theirs = unit_of(modules[t])
            if theirs != mine and level[theirs] >= level[mine]:
                wrong.append(f"{name} ({mine}, floor {level[mine]}) imports {t} ({theirs}, floor {level[theirs]})")
    assert not wrong, "imports that climb or cross a floor:\n" + "\n".join(sorted(wrong))


def test_no_import_cycle(graph):
    _, edges = graph
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_only_compat_touches_private_torch(graph):
    modules, _ = graph
    found = {name: private_torch(path) for name, path in modules.items() if unit_of(path) != "_compat/"}
    found = {name: where for name, where in found.items() if where}
    assert not found, f"private torch API outside _compat/: {found}"


def test_the_checks_see_violations(tmp_path):
    """The helpers find what they look for (a check that cannot fail would prove nothing)."""
    bad = tmp_path / "bad.py"
    bad.write_text("import torch._dynamo\nfrom torch._inductor import config\nx = torch._C\n")
    assert len(private_torch(bad)) == 3
    assert floors()["_compat/"] == 0 and floors()["launch/"] > floors()["compiler/"] > floors()["distributed/"]
