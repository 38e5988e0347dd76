"""Lightning Trainer recipe (docs/integrations-recipes.md) on 2 gloo ranks started by the Trainer's
own launcher: parameters and losses after a few steps equal the eager Trainer's; bucketwise's stats
say which strategy ran."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("lightning")

from _integration import assert_same_training, free_port, run_recipe, strategies  # noqa: E402


def test_lightning_trainer_recipe(tmp_path, monkeypatch):
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    out = run_recipe([sys.executable], "lightning_trainer_recipe.py", tmp_path)
    assert_same_training(out)
    # The network is compiled inside the module DDP wraps: DDP's reducer reduces, graphs are split
    # at its buckets (one whole graph per step handed to bucketwise, not torch's DDPOptimizer pieces).
    assert strategies(out) == [["split"], ["split"]]
