"""The docs point at things that exist: ``NOTE [...]`` blocks in the code, local links and their
anchors, results folders. (The performance tables: tests/test_perf_tables.py.)"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RESULTS = ROOT / "benchmarks" / "results"


def _code_files() -> list[Path]:
    return [p for p in ROOT.rglob("*.py") if RESULTS not in p.parents and ".git" not in p.parts]


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_every_note_named_in_the_docs_exists_in_the_code():
    defined = set()
    for path in _code_files():
        defined |= set(re.findall(r"NOTE \[([^\]]+)\]:", path.read_text()))
    for page in PAGES:
        for name in re.findall(r"NOTE \[([^\]]+)\]", page.read_text()):
            if name == "...":
                continue
            assert name in defined, f"{page.name} names NOTE [{name}], which no code file defines"


def test_local_links_and_anchors_resolve():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            assert resolved.exists(), f"{page.name}: link to {target} does not resolve"
            if anchor:
                assert anchor in _anchors(resolved), f"{page.name}: no heading for #{anchor} in {resolved.name}"


def test_results_folders_named_in_the_docs_exist():
    for page in PAGES:
        for name in re.findall(r"\b(20\d\d-\d\d-\d\d_[\w.-]+?)(?=[/`)\s]|$)", page.read_text()):
            assert (RESULTS / name).is_dir(), f"{page.name} names results folder {name}, which does not exist"
