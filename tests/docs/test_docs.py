"""The docs point at things that exist: ``NOTE [...]`` blocks in the code, local links and their
anchors, results folders. (The performance tables: tests/benchmarks/test_perf_tables.py.)"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [
    ROOT / "README.md",
    ROOT / "CHANGELOG.md",
    ROOT / "benchmarks" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
]
RESULTS = ROOT / "benchmarks" / "results"


def _code_files() -> list[Path]:
    # Not under a hidden folder (``.git``, a virtual environment, a scratch copy of the package).
    return [
        p
        for p in ROOT.rglob("*.py")
        if RESULTS not in p.parents and not any(part.startswith(".") for part in p.relative_to(ROOT).parts)
    ]


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


def _definitions() -> dict[str, list[str]]:
    """NOTE name -> the files defining it (``NOTE [name]:``), tests' own files apart."""
    out: dict[str, list[str]] = {}
    for path in _code_files():
        if path.name.startswith("test_"):
            continue
        for name in re.findall(r"NOTE \[([^\]]+)\]:", path.read_text()):
            out.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return out


def test_every_note_is_defined_once_and_every_reference_resolves():
    defined = _definitions()
    twice = {name: files for name, files in defined.items() if len(files) > 1}
    assert not twice, f"NOTEs defined in more than one place (a reference is written without the colon): {twice}"
    for path in _code_files():
        for name in re.findall(r"NOTE \[([^\]]+)\]", path.read_text()):
            name = re.sub(r"\s*\n\s*#?\s*", " ", name)  # a name wrapped over two lines (of a comment)
            if name in ("...", "{name}", "name") or "\\" in name:
                continue
            assert name in defined, f"{path.relative_to(ROOT)} names NOTE [{name}], which no code file defines"


def test_design_md_maps_every_note_to_its_file():
    rows = dict(re.findall(r"^\| `NOTE \[([^\]]+)\]` \| `([^`]+)` \|", (ROOT / "docs" / "design.md").read_text(), re.M))
    defined = _definitions()
    assert set(rows) == set(defined), (
        f"docs/design.md misses {sorted(set(defined) - set(rows))}, lists undefined {sorted(set(rows) - set(defined))}"
    )
    wrong = {name: (rows[name], files[0]) for name, files in defined.items() if rows[name] != files[0]}
    assert not wrong, f"docs/design.md names the wrong file (page, code): {wrong}"


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


# -- scripts the docs show (NOTE [docs include their scripts] in tests/docs/doc_includes.py) ----------


def test_included_blocks_equal_their_files():
    import doc_includes

    assert doc_includes.stale() == [], "run: python tests/docs/doc_includes.py --write"


def test_runnable_python_blocks_are_included_files():
    """A Python block that is a whole script (it has a ``__main__`` guard) must be an included
    file, so a test runs what the page shows."""
    import doc_includes

    for page in doc_includes.PAGES:
        included = {text for _, text in doc_includes.includes(page)}
        for block in re.findall(r"^```python\n(.*?)^```\n", page.read_text(), re.M | re.S):
            if "__main__" in block:
                assert block in included, f"{page.name}: a runnable script that is not an included file:\n{block[:300]}"


def test_every_recipe_file_is_shown_and_run():
    import doc_includes

    shown = {path for page in doc_includes.PAGES for path, _ in doc_includes.includes(page)}
    runner = (ROOT / "tests" / "docs" / "test_doc_recipes.py").read_text()
    for path in sorted((ROOT / "docs" / "recipes").glob("*.py")):
        rel = str(path.relative_to(ROOT))
        assert rel in shown, f"{rel} is shown by no page (<!-- include {rel} -->)"
        assert f'"{path.name}"' in runner, f"{rel} is run by no test in tests/docs/test_doc_recipes.py"


def test_the_readme_commands_are_files_ci_runs_in_new_environments():
    # The shell commands a user copies from the README are the files .ci/run executes, each in
    # a new virtual environment: the page, the file and CI cannot disagree.
    import doc_includes

    shown = {path for path, _ in doc_includes.includes(ROOT / "README.md")}
    ci = (ROOT / ".ci" / "run").read_text()
    scripts = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs" / "recipes").glob("*.sh"))
    assert {"docs/recipes/install_torch_cpu.sh", "docs/recipes/install_and_demo.sh"} <= set(scripts)
    for rel in scripts:
        assert rel in shown, f"{rel} is shown by no README block (<!-- include {rel} -->)"
        assert f"bash -euxo pipefail {rel}" in ci, f"{rel} is not run by .ci/run"
    assert ci.count("python3 -m venv") == 1 and "in_env readme" in ci and "in_env newest" in ci


# -- the error table of docs/troubleshooting.md ---------------------------------------------------

ERROR_ROW = re.compile(
    r"^\| `((?:compile|report)\([^`]*\))`(?P<when>[^|]*)\| (?P<kind>[^|]+?) \| (?P<msg>.*) \|$", re.M
)
# What the text after the call says about where the row applies; other rows are runs across ranks
# or after setup this test cannot make (their tests: tests/distributed/test_bad_input.py).
WHEN = {"": True, "of a module not compiled by bucketwise": True}


def _error_rows() -> list[tuple[str, str, str]]:
    import torch

    when = {**WHEN, "without a GPU": not torch.cuda.is_available(), "on a machine with CUDA": torch.cuda.is_available()}
    rows = []
    for m in ERROR_ROW.finditer((ROOT / "docs" / "troubleshooting.md").read_text()):
        condition = m.group("when").strip()
        if when.get(condition, False):
            rows.append((m.group(1), m.group("kind").split(" (")[0], m.group("msg")))
    return rows


def _matches(message: str, documented: str) -> bool:
    """The documented message, which may end in ``...`` (the rest cut)."""
    if documented.endswith("..."):
        return message.startswith(documented[:-3].rstrip())
    return message == documented


def test_error_table_rows_are_what_the_code_raises(caplog):
    """Each row that is one call is made, and must raise (or warn) as the table says."""
    import logging

    import torch.nn as nn

    import bucketwise

    rows = _error_rows()
    assert len(rows) >= 13, rows  # the table's single-call rows, so this test cannot pass by finding none
    for expr, kind, documented in rows:
        scope = {
            "compile": bucketwise.compile,
            "report": bucketwise.report,
            "ddp": nn.Linear(2, 2),
            "model": nn.Linear(2, 2),
            "nn": nn,
        }
        caplog.clear()
        try:
            with caplog.at_level(logging.WARNING, logger="bucketwise"):
                eval(expr.replace("{...}", '{"max_autotune": True}'), scope)  # noqa: S307 - the docs' own rows
        except Exception as exc:  # noqa: BLE001
            first = str(exc).splitlines()[0]
            assert type(exc).__name__ == kind, f"{expr}: raised {type(exc).__name__}, the table says {kind}"
            assert _matches(first, documented), f"{expr}:\n  raises {first!r}\n  table  {documented!r}"
        else:
            assert kind == "warning", f"{expr}: raised nothing, the table says {kind}"
            assert any(_matches(r.getMessage(), documented) for r in caplog.records), (expr, caplog.text)


def test_user_guide_names_every_hook_that_runs_fused():
    """docs/comm-hooks.md's table is the list of hooks ``fused`` reproduces; the user guide's
    strategy advice must name each of them."""
    table = (ROOT / "docs" / "comm-hooks.md").read_text()
    fused_rows = re.findall(r"^\| (.*?) \| fused", table, re.M)
    hooks = {h for row in fused_rows for h in re.findall(r"`([\w.]*hook)`", row)}
    assert {"allreduce_hook", "powerSGD_hook", "bucketwise.traceable_comm_hook"} <= hooks, hooks
    guide = (ROOT / "docs" / "user-guide.md").read_text()
    advice = guide[guide.index("- **`fused`** needs") : guide.index("- **`split`**")]
    missing = sorted(h for h in hooks if f"`{h}`" not in advice)
    assert not missing, f"user-guide.md's `fused` advice does not name {missing}"


def test_no_page_asks_users_to_release_cuda_graphs_before_destroying_the_group():
    """bucketwise releases the fused CUDA graphs at destroy_process_group() (NOTE in
    distributed/teardown.py); no page may tell users to do it themselves first."""
    for page in PAGES:
        text = " ".join(page.read_text().split())
        assert "release the compiled graphs before" not in text, page.name


# -- the README as a package index shows it ---------------------------------------------------------

REPOSITORY = "https://github.com/bucketwise/bucketwise"


def _readme_outside_generated_tables() -> str:
    """README.md, the block benchmarks/tables/perf.py writes included."""
    return (ROOT / "README.md").read_text()


def test_readme_links_are_absolute_and_resolve_in_this_checkout():
    """A package index shows README.md away from the repository: every link must be absolute, and
    a link into the repository must name a file (blob) or folder (tree) of this checkout."""
    prefix = re.compile(rf"^{re.escape(REPOSITORY)}/(blob|tree)/main/([^#]+)(?:#(.*))?$")
    links = re.findall(r"\]\(([^)\s]+)\)", _readme_outside_generated_tables())
    assert len(links) >= 10, links
    for target in links:
        assert re.match(r"https?://", target), f"README.md: relative link {target} breaks on a package index page"
        m = prefix.match(target)
        if not m:
            continue
        kind, path, anchor = m.groups()
        resolved = ROOT / path
        assert resolved.is_dir() if kind == "tree" else resolved.is_file(), f"README.md: {target} names no {kind}"
        if anchor:
            assert anchor in _anchors(resolved), f"README.md: no heading for #{anchor} in {path}"


def test_project_urls_name_the_repository():
    text = (ROOT / "pyproject.toml").read_text()
    urls = dict(re.findall(r'^(\w+) = "(https://[^"]+)"$', text.split("[project.urls]")[1].split("\n[")[0], re.M))
    assert urls["Repository"] == REPOSITORY and urls["Homepage"] == REPOSITORY, urls
    assert all(u.startswith(REPOSITORY) for u in urls.values()), urls
    assert "License :: OSI Approved :: BSD License" in text and (ROOT / "LICENSE").read_text().startswith(
        "BSD 3-Clause"
    )
