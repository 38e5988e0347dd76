"""NOTE [reductions into bucket views] (_compat/inductor.py): where torch's mix-order reduction loses
its results computed into a bucket, every compile that gathers gradients into buckets runs with
it off, the others keep torch's setting, and ``fused`` refuses an option that turns it on.

The wrong gradients themselves need a GPU (the reduction is Triton's):
tests/gpu/test_gpu_norm_grads.py compares them with eager DDP's."""

from __future__ import annotations

import uuid

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import bucketwise
from bucketwise._compat import collectives as cc
from bucketwise._compat import inductor as ci
from bucketwise.compiler.config import CompileConfig


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.relu(self.fc(x)))).sum()


def _settings_seen(strategy: str) -> list[bool]:
    """The mix-order reduction setting inside each of Inductor's compiles of one step."""
    seen: list[bool] = []

    def record(graph) -> None:
        seen.append(torch._inductor.config.triton.mix_order_reduction)

    # A key of its own each time: a graph from Inductor's cache would run no pass at all.
    key = f"bucketwise-test-record-mix-order-{uuid.uuid4()}"
    options = {"post_grad_custom_post_pass": cc.post_grad_pass(record, key)}
    model = bucketwise.compile(DDP(_Net()), strategy=strategy, options=options, share_blocks=False)
    model(torch.randn(4, 8)).backward()
    return seen


@pytest.mark.usefixtures("single_rank_group")
def test_fused_compiles_run_without_the_reduction_where_torch_loses_its_results():
    torch_default = torch._inductor.config.triton.mix_order_reduction
    fused = _settings_seen("fused")
    # The forward graph and the backward graph, which gathers the gradients into a bucket.
    assert len(fused) == 2
    assert fused == [torch_default and not ci.reductions_into_views_lost()] * 2
    torch._dynamo.reset()
    # split leaves the gradients to DDP's reducer: torch's own setting.
    assert set(_settings_seen("split")) == {torch_default}


def test_fused_refuses_the_option_that_turns_the_reduction_on_where_torch_loses_its_results():
    options = {ci.MIX_ORDER_REDUCTION: True}
    if not ci.reductions_into_views_lost():
        CompileConfig(strategy="fused", options=options)  # torch >= 2.15 writes through the bucket
        return
    for strategy in ("fused", "auto"):
        with pytest.raises(ValueError, match=r"triton\.mix_order_reduction.*pytorch/pytorch#193061.*strategy='split'"):
            CompileConfig(strategy=strategy, options=options)
    CompileConfig(strategy="split", options=options)
    CompileConfig(strategy="fused", options={ci.MIX_ORDER_REDUCTION: False})


def test_releases_with_the_reduction_before_the_fix_are_the_ones_patched():
    assert ci.reductions_into_views_lost() == (torch.torch_version.TorchVersion(torch.__version__) < "2.15")
    assert ci.bucket_safe_patches() == ({ci.MIX_ORDER_REDUCTION: False} if ci.reductions_into_views_lost() else {})
