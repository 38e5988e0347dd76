"""Code blocks of the docs that are whole files (NOTE [docs include their scripts]).

A line ``<!-- include docs/recipes/NAME.py -->`` in a page is followed by a fenced code block
that must be exactly that file (path from the repository root). ``python tests/docs/doc_includes.py
--write`` rewrites every such block from its file; without ``--write`` it lists the blocks that
differ and exits 1. ``tests/docs/test_docs.py`` fails while any block differs.

NOTE [docs include their scripts]: a script a user is meant to run lives in a file that a test
runs as it is (tests/docs/test_doc_recipes.py), and the page shows that file through an include
marker, so the page, the file and the test cannot disagree.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!-- include (\S+) -->\n```(\w*)\n(.*?)^```\n", re.M | re.S)


def includes(page: Path) -> list[tuple[str, str]]:
    """``[(path, block text)]`` of every include marker of ``page``."""
    return [(m.group(1), m.group(3)) for m in MARKER.finditer(page.read_text())]


def stale() -> list[str]:
    """``"page: path"`` for every block that differs from its file."""
    return [
        f"{page.relative_to(ROOT)}: {path}"
        for page in PAGES
        for path, text in includes(page)
        if text != (ROOT / path).read_text()
    ]


def write() -> None:
    for page in PAGES:
        text = page.read_text()
        new = MARKER.sub(
            lambda m: f"<!-- include {m.group(1)} -->\n```{m.group(2)}\n{(ROOT / m.group(1)).read_text()}```\n", text
        )
        if new != text:
            page.write_text(new)
            print(f"rewrote {page.relative_to(ROOT)}")


if __name__ == "__main__":
    if "--write" in sys.argv[1:]:
        write()
    else:
        differ = stale()
        print("\n".join(differ) or "every included block equals its file")
        sys.exit(1 if differ else 0)
