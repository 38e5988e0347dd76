"""accelerate recipe (docs/integrations-recipes.md) on 2 gloo ranks under ``accelerate launch``:
parameters and losses after a few steps equal the eager loop's; bucketwise's stats say which
strategy ran."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from _integration import assert_same_training, free_port, run_recipe, strategies  # noqa: E402


def test_accelerate_recipe(tmp_path):
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                "--main_process_port", str(free_port())]
    out = run_recipe(launcher, "accelerate_recipe.py", tmp_path)
    # fused averages each bucket in the compiled backward: equal to DDP's reducer up to rounding
    assert_same_training(out, atol=1e-5)
    # compile wraps the DDP module prepare() built (find_unused_parameters=False): auto picks fused.
    assert strategies(out) == [["fused"], ["fused"]]
