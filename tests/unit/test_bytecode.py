"""Whether torch's compile modules run from cached bytecode (NOTE [compiled bytecode]): the
check against files Python itself compiles, the warning ``bucketwise.compile`` gives where every
process would compile them again, and the report's ``python_bytecode``."""

from __future__ import annotations

import importlib.util
import logging
import os
import py_compile
import sys

import pytest
import torch
import torch.nn as nn

import bucketwise
from bucketwise.stats import bytecode

SAMPLES = ("a.py", "sub/b.py")


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A package of two modules, cached under a prefix of its own (so nothing else's cache is
    touched), without bytecode yet."""
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "pycache"))
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("A = 1\n")
    (pkg / "sub" / "b.py").write_text("B = 2\n")
    return pkg


def compile_all(pkg) -> None:
    for name in SAMPLES:
        py_compile.compile(str(pkg / name), doraise=True)


def test_cached_once_python_compiled_every_module(package, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    compile_all(package)
    found = bytecode.check(str(package), SAMPLES)
    assert found.state is bytecode.BytecodeState.CACHED and found.missing == ()
    assert found.warning() is None


def test_a_changed_source_is_not_cached(package, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    compile_all(package)
    (package / "sub" / "b.py").write_text("B = 22\n")  # another size: the cached header no longer matches
    found = bytecode.check(str(package), SAMPLES)
    assert found.state is bytecode.BytecodeState.EVERY_PROCESS and found.missing == ("sub/b.py",)


def test_bytecode_of_another_python_is_not_cached(package):
    compile_all(package)
    cached = importlib.util.cache_from_source(str(package / "a.py"))
    with open(cached, "r+b") as f:
        f.write(b"\0\0\0\0")  # another magic number
    found = bytecode.check(str(package), SAMPLES)
    assert found.missing == ("a.py",)


def test_no_bytecode_and_none_kept_warns_with_the_fix(package, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    found = bytecode.check(str(package), SAMPLES)
    assert found.state is bytecode.BytecodeState.EVERY_PROCESS
    assert found.missing == SAMPLES and "PYTHONDONTWRITEBYTECODE" in found.kept_from
    message = found.warning()
    assert f"{sys.executable} -m compileall -q -j 0 {package.parent}" in message
    assert "unset PYTHONDONTWRITEBYTECODE" in message and str(package / "a.py") in message


def test_no_bytecode_yet_but_python_keeps_it(package, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    found = bytecode.check(str(package), SAMPLES)
    assert found.state is bytecode.BytecodeState.SAVED_AT_FIRST_IMPORT and found.warning() is None


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_cache_folder_keeps_nothing(package, monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    prefix = tmp_path / "read-only"
    prefix.mkdir()
    prefix.chmod(0o555)
    monkeypatch.setattr(sys, "pycache_prefix", str(prefix))
    try:
        found = bytecode.check(str(package), SAMPLES)
    finally:
        prefix.chmod(0o755)
    assert found.state is bytecode.BytecodeState.EVERY_PROCESS and "not writable" in found.kept_from
    assert "PYTHONPYCACHEPREFIX" in found.warning()


def test_the_installed_torch_is_checked_where_python_caches_it():
    """The check follows the process's own cache settings: the torch imported here ran from
    the bytecode it finds, so it is cached or will be."""
    found = bytecode.torch_bytecode()
    assert found.package == os.path.dirname(torch.__file__)
    assert all(os.path.isfile(os.path.join(found.package, s)) for s in bytecode.SAMPLES)
    if not sys.dont_write_bytecode:
        assert found.state is not bytecode.BytecodeState.EVERY_PROCESS, found


@pytest.mark.parametrize("local_rank, warns", [("0", True), ("1", False)])
def test_compile_warns_on_local_rank_0_and_the_report_says_so(tmp_path, monkeypatch, caplog, local_rank, warns):
    """No bytecode for torch under an empty cache prefix, and Python may not keep any."""
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "empty"))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    with caplog.at_level(logging.WARNING, logger="bucketwise"):
        compiled = bucketwise.compile(nn.Linear(4, 4), backend="eager")
    said = [r.getMessage() for r in caplog.records if "compiles torch's modules from source" in r.getMessage()]
    assert len(said) == (1 if warns else 0), said
    compiled(torch.randn(2, 4)).sum().backward()
    report = bucketwise.report(compiled)
    assert report.totals["python_bytecode"] == bytecode.BytecodeState.EVERY_PROCESS.value
    assert "python bytecode: torch's modules are compiled from source in every process" in report.table()


def test_no_warning_where_python_keeps_what_it_compiles(tmp_path, monkeypatch, caplog):
    """An empty cache prefix Python may write to: the first process pays once, no warning."""
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "empty"))
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    with caplog.at_level(logging.WARNING, logger="bucketwise"):
        compiled = bucketwise.compile(nn.Linear(4, 4), backend="eager")
    assert not [r for r in caplog.records if "compiles torch's modules from source" in r.getMessage()]
    compiled(torch.randn(2, 4)).sum().backward()
    state = bucketwise.report(compiled).totals["python_bytecode"]
    assert state == bytecode.BytecodeState.SAVED_AT_FIRST_IMPORT.value
