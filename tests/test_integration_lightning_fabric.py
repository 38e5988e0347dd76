"""Lightning Fabric recipe (docs/integrations-recipes.md) on 2 gloo ranks started by Fabric's own
launcher: parameters and losses after a few steps equal the eager loop's; bucketwise's stats say
which strategy ran."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("lightning")

from _integration import assert_same_training, run_recipe, strategies  # noqa: E402


def test_fabric_recipe(tmp_path, monkeypatch):
    from _integration import free_port

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    out = run_recipe([sys.executable], "fabric_recipe.py", tmp_path)
    assert_same_training(out, atol=1e-5)
    # Fabric compiles its DDP module: bucketwise runs DDP's forward, auto picks fused.
    assert strategies(out) == [["fused"], ["fused"]]
