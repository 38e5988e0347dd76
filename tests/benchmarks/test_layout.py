"""The benchmarks' layout: subpackages on floors, names shared only when public, results as data.

Floors, lowest first: ``core`` (configs, models, steps, processes, run metadata, output);
``tables`` (docs tables and plots from results); the harnesses ``ddp``, ``tax``, ``zoo``,
``apps``; ``probes``; the front door (``__main__``). A module imports its own subpackage or
lower floors, and never an underscore name of another module.
"""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
FLOORS = {"core": 0, "tables": 1, "ddp": 2, "tax": 2, "zoo": 2, "apps": 2, "probes": 3, "__main__": 4, "__init__": 4}
PREFIX = "bucketwise.benchmarks."


def _modules() -> list[Path]:
    return [p for p in BENCH.rglob("*.py") if "results" not in p.relative_to(BENCH).parts]


def _group(path: Path) -> str:
    rel = path.relative_to(BENCH)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(benchmarks module imported, names taken from it), anywhere in the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PREFIX):
            out.append((node.module.removeprefix(PREFIX), [a.name for a in node.names]))
        elif isinstance(node, ast.ImportFrom) and node.level and path.name == "__main__.py":
            out.append((node.module or "probes", [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out += [(a.name.removeprefix(PREFIX), []) for a in node.names if a.name.startswith(PREFIX)]
    return out


def test_every_module_sits_in_a_known_subpackage():
    groups = {_group(p) for p in _modules()}
    assert groups <= set(FLOORS), f"expected only {sorted(FLOORS)}, got {sorted(groups - set(FLOORS))}"


def test_imports_go_to_the_same_subpackage_or_lower_floors():
    bad = []
    for path in _modules():
        own = _group(path)
        for module, _ in _imports(path):
            other = module.split(".")[0]
            if other != own and FLOORS.get(other, 99) >= FLOORS[own]:
                bad.append(f"{path.relative_to(BENCH)} imports {module}")
    assert not bad, "\n".join(bad)


def test_no_module_takes_an_underscore_name_from_another():
    bad = [
        f"{path.relative_to(BENCH)}: {name} from {module}"
        for path in _modules()
        for module, names in _imports(path)
        for name in names
        if name.startswith("_") and name != "__version__"
    ]
    assert not bad, "\n".join(bad)


def test_results_hold_data_and_readmes_only():
    code = sorted(str(p.relative_to(BENCH)) for p in (BENCH / "results").rglob("*") if p.suffix in (".py", ".sh"))
    assert not code, f"scripts belong in benchmarks/probes/, not results/: {code}"


INTERNALS = ("bucketwise._compat", "bucketwise.compiler")
"""Packages of the library a benchmark may not import: torch's private API as the library wraps it,
and the compiler's internals (the public API is the ``bucketwise`` root)."""
TORCH_PATHS = "bucketwise._compat.torch_paths"
"""The one exception: torch's own compiled-DDP paths the docs compare with, which only torch's
private API selects (private torch API lives in ``_compat/`` only)."""


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _private(dotted: str) -> bool:
    return any(p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in dotted.split("."))


def _absolute(path: Path, node: ast.ImportFrom) -> str:
    """The module an ``import from`` names, a relative one resolved against the benchmarks package."""
    if not node.level:
        return node.module or ""
    package = ["bucketwise", "benchmarks", *path.relative_to(BENCH).parent.parts]
    base = package[: len(package) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def test_benchmarks_use_bucketwise_through_its_public_api():
    bad = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                module = _absolute(path, node)
                named = [f"{module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                named = [a.name for a in node.names]
            else:
                continue
            bad += [
                f"{path.relative_to(BENCH)}: {n}"
                for n in named
                if n.startswith(INTERNALS) and not (n == TORCH_PATHS or n.startswith(TORCH_PATHS + "."))
            ]
    assert not bad, "\n".join(bad)


def test_benchmarks_reach_no_private_torch_api():
    bad = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
                names = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.split(".")[0] == "torch"]
            elif isinstance(node, ast.Attribute) and (dotted := _dotted(node)) and dotted.split(".")[0] == "torch":
                names = [dotted]
            else:
                continue
            bad += [f"{path.relative_to(BENCH)}:{node.lineno}: {n}" for n in names if _private(n)]
    assert not bad, "\n".join(sorted(set(bad)))
