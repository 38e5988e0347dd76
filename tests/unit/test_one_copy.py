"""The suite runs the installed package once, whatever the checkout's folder is called
(NOTE [one copy of the package] in the root ``__init__.py``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import bucketwise

ROOT = Path(__file__).resolve().parents[2]


def test_root_init_under_any_name_reexports_the_installed_package():
    # What pytest does for a checkout folder with an __init__.py: run it as a module named after
    # the folder, which need not be an identifier (a zip download unpacks to bucketwise-main).
    spec = importlib.util.spec_from_file_location("bucketwise-main", ROOT / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.compile is bucketwise.compile and module.report is bucketwise.report


def test_no_module_of_the_package_is_loaded_twice():
    inside = {}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if not path or name.startswith(("test_", "conftest", "_")):
            continue
        path = Path(path).resolve()
        if not path.is_file():  # torch.ops and torch.classes name files that are not there
            continue
        if (
            ROOT in path.parents
            and path.parts[len(ROOT.parts)] not in ("tests", "benchmarks")
            and path != ROOT / "__init__.py"
        ):
            inside.setdefault(path, []).append(name)
    twice = {str(p): names for p, names in inside.items() if len(names) > 1 or not names[0].startswith("bucketwise")}
    assert not twice, f"expected each module of the package once, as bucketwise.*, got {twice}"
