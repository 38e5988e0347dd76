"""HF Trainer given a model compiled with ``backend="bucketwise"`` (docs/integrations-recipes.md, the
way without ``BucketwiseTrainer``) on 2 gloo ranks under torchrun: parameters and losses after a
few steps equal the eager Trainer's; bucketwise's stats say which strategy ran (``split``). The
``BucketwiseTrainer`` recipe (``fused``): tests/docs/test_doc_recipes.py."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from support.integration import assert_same_training, run_recipe, strategies  # noqa: E402


def test_hf_trainer_recipe(tmp_path):
    out = run_recipe(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"],
        "hf_trainer_recipe.py",
        tmp_path,
    )
    assert_same_training(out)
    # DDP wraps the compiled model: split, DDP's reducer reduces.
    assert strategies(out) == [["split"], ["split"]]
