"""One version: pyproject.toml's, ``bucketwise.__version__`` and ``bucketwise --version`` agree."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import bucketwise
from bucketwise.launch import cli

ROOT = Path(__file__).resolve().parents[2]


def _pyproject_version() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    project = text.split("[project]", 1)[1].split("\n[", 1)[0]
    match = re.search(r'^version\s*=\s*"([^"]+)"\s*$', project, re.M)
    assert match, 'expected a version = "..." line in pyproject.toml\'s [project] table'
    return match.group(1)


def test_pyproject_version_is_the_package_version():
    assert _pyproject_version() == bucketwise.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", bucketwise.__version__), bucketwise.__version__


def test_changelog_names_the_version():
    assert f"## {bucketwise.__version__}" in (ROOT / "CHANGELOG.md").read_text().splitlines()


def test_cli_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"bucketwise {bucketwise.__version__}\n"


def test_cli_version_as_a_command():
    out = subprocess.run(
        [sys.executable, "-m", "bucketwise.launch.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert out == f"bucketwise {bucketwise.__version__}\n"


def test_readme_names_the_version():
    readme = (ROOT / "README.md").read_text()
    named = re.findall(r"Version (\d+\.\d+\.\d+)", readme)
    assert named == [bucketwise.__version__], (
        f"README.md names version(s) {named}, the package is {bucketwise.__version__}"
    )
