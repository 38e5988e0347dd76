"""The suite's own guard (conftest.py, tests/support/torch_state.py): a test that leaves torch's config or
the process changed for the next test is caught, naming what it changed."""

from __future__ import annotations

import os

import torch
import torch._functorch.config
from support.torch_state import config_changes, config_snapshot, process_changes, process_snapshot


def test_a_config_option_changed_or_missing_is_named():
    before = {"torch._functorch.config": {"donated_buffer": True, "other": 1}}
    after = {"torch._functorch.config": {"other": 2}}
    assert config_changes(before, after) == [
        "torch._functorch.config.donated_buffer is missing (it was True)",
        "torch._functorch.config.other changed from 1 to 2",
    ]


def test_the_snapshot_sees_a_patch_and_its_undo():
    before = config_snapshot()
    assert "torch._functorch.config" in before and "torch._dynamo.config" in before
    flag = torch._functorch.config.donated_buffer
    with torch._functorch.config.patch(donated_buffer=not flag):
        assert config_changes(before, config_snapshot()) == [
            f"torch._functorch.config.donated_buffer changed from {flag!r} to {not flag!r}"
        ]
    assert config_changes(before, config_snapshot()) == []


def test_an_environment_variable_or_a_global_mode_left_behind_is_named(monkeypatch):
    before = process_snapshot()
    monkeypatch.setenv("BUCKETWISE_HYGIENE_PROBE", "1")
    with torch.no_grad():
        changes = process_changes(before, process_snapshot())
    assert changes == ["environment variable BUCKETWISE_HYGIENE_PROBE: None -> '1'", "grad mode: True -> False"]
    monkeypatch.delenv("BUCKETWISE_HYGIENE_PROBE")
    assert "BUCKETWISE_HYGIENE_PROBE" not in os.environ
    assert process_changes(before, process_snapshot()) == []


KINDS = ("unit", "distributed", "cli", "benchmarks", "integrations", "docs", "gpu")


def test_tests_are_grouped_by_kind_and_share_only_the_support_package():
    import ast
    from pathlib import Path

    tests = Path(__file__).resolve().parents[1]
    modules = sorted(tests.rglob("test_*.py"))
    assert modules, f"expected test modules under {tests}"
    names = {p.stem for p in modules}
    for path in modules:
        kind = path.relative_to(tests).parts[0]
        assert kind in KINDS, f"{path.relative_to(tests)}: expected under one of {KINDS}, got {kind!r}"
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module.split(".")[0])
        shared = imported & names
        assert not shared, (
            f"{path.relative_to(tests)} imports test modules {sorted(shared)}: move what they share to tests/support/"
        )
