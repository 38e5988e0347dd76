"""Make the ``torch_dynamo_backends`` entry points that ``pyproject.toml`` declares visible to a
process, as ``pip install`` makes them, without reinstalling the package.

An installed bucketwise (``pip install -e .``, what CI does) already carries them; a checkout
used through ``PYTHONPATH`` does not. ``entry_point_dir(tmp)`` writes a small ``*.dist-info``
holding exactly the declared entry points (read from ``pyproject.toml``) and returns its folder:
put it first on ``sys.path`` / ``PYTHONPATH`` of the processes under test.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GROUP = "torch_dynamo_backends"


def declared_entry_points() -> dict[str, str]:
    """``{name: "module:object"}`` of the ``torch_dynamo_backends`` group in pyproject.toml
    (read with a regular expression: ``tomllib`` needs Python 3.11)."""
    text = (ROOT / "pyproject.toml").read_text()
    table = re.search(rf"^\[project\.entry-points\.{GROUP}\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
    if table is None:
        return {}
    return dict(re.findall(r'^(\w[\w.-]*)\s*=\s*"([^"]+)"', table.group(1), re.M))


def entry_point_dir(tmp: Path) -> Path:
    """A folder holding ``bucketwise_entry_points-0.dist-info`` with the declared entry points."""
    folder = Path(tmp) / "entry-points"
    info = folder / "bucketwise_entry_points-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: bucketwise-entry-points\nVersion: 0\n")
    lines = [f"[{GROUP}]"] + [f"{name} = {target}" for name, target in declared_entry_points().items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return folder
