"""The wheel a release would publish: it carries the LICENSE, the project URLs and classifiers,
the modules users import (``bucketwise.hf`` included) and the ``torch.compile`` entry point."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("setuptools")

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_carries_license_and_metadata(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "results", "__pycache__"))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            str(src),
            "-w",
            str(tmp_path / "dist"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (wheel,) = (tmp_path / "dist").glob("bucketwise-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        metadata = z.read(f"{info}/METADATA").decode()
        license_files = [n for n in names if n.startswith(info) and n.endswith("LICENSE")]
        assert license_files and z.read(license_files[0]).decode() == (ROOT / "LICENSE").read_text()
        assert (
            "bucketwise = bucketwise.compiler.dynamo_backend:bucketwise_backend"
            in z.read(f"{info}/entry_points.txt").decode()
        )
    for line in (
        "License: BSD-3-Clause",
        "Project-URL: Repository, https://github.com/bucketwise/bucketwise",
        "Classifier: License :: OSI Approved :: BSD License",
    ):
        assert line in metadata, f"{line!r} not in METADATA:\n{metadata[:2000]}"
    for module in ("bucketwise/__init__.py", "bucketwise/hf.py", "bucketwise/launch/cli.py"):
        assert module in names, module
    # Every subpackage of the source tree (benchmarks/probes included), not only those named above.
    packages = [
        "bucketwise/" + init.relative_to(ROOT).as_posix()
        for init in ROOT.rglob("__init__.py")
        if init.relative_to(ROOT).parts[0] not in ("tests", "docs", "build")
        and "results" not in init.parts
        and not init.relative_to(ROOT).parts[0].startswith(".")
    ]
    missing = [p for p in packages if p not in names]
    assert not missing, f"subpackages not in the wheel (pyproject.toml's packages): {missing}"
    assert not any(n.startswith(("bucketwise/tests/", "bucketwise/docs/", "tests/")) for n in names), names
