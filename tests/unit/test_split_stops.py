"""``split`` with torch's PowerSGD hooks on gloo: refused where DDP's reducer would stop for good
(NOTE [PowerSGD on gloo]), trained as eager DDP where it would not (one bucket).

Eager DDP itself stops at the first compressed step with several buckets on gloo
(benchmarks/results/2026-12-03_cpu-1rank_powersgd-gloo-deadlock), so these tests never run a
compressed step with several buckets."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
from torch.nn.parallel import DistributedDataParallel as DDP

import bucketwise
from bucketwise._compat import ddp as ddpc
from bucketwise.launch.models import GPT, GPTConfig, synthetic_tokens

CFG = GPTConfig(vocab=128, seq=16, layers=2, d_model=32, heads=2)
SEVERAL = 0.01
"""A ``bucket_cap_mb`` that makes several buckets of the model's gradients."""


def _ddp(model: torch.nn.Module, *, cap_mb: float, hook=ps.powerSGD_hook) -> DDP:
    ddp = DDP(model, bucket_cap_mb=cap_mb)
    state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    ddp.register_comm_hook(state, hook)
    return ddp


def _batch(step: int):
    return synthetic_tokens(CFG, 2, seed=step)


def test_explicit_split_is_refused_at_compile_naming_the_fixes(single_rank_group):
    torch.manual_seed(0)
    ddp = _ddp(GPT(CFG), cap_mb=SEVERAL)
    with pytest.raises(ValueError) as err:
        bucketwise.compile(ddp, strategy="split")
    text = str(err.value)
    assert text.startswith("strategy='split' cannot train DDP(GPT): DDP's reducer runs torch's powerSGD_hook"), text
    assert "gloo's 2 worker threads" in text and "start_powerSGD_iter 2" in text, text
    assert "Pass strategy='auto'" in text and "bucket_cap_mb=1) for one bucket" in text, text
    assert ddpc.owner_of(ddp) is None  # nothing was built around the module


def test_auto_falling_back_to_split_is_refused_then_trains_once_fused_applies(single_rank_group):
    torch.manual_seed(0)
    ddp = _ddp(GPT(CFG), cap_mb=SEVERAL)
    handle = ddp.module.head.weight.register_hook(lambda g: g)  # a gradient hook: auto cannot run fused
    run = bucketwise.compile(ddp, backend="aot_eager")
    x, y = _batch(0)
    with pytest.raises(ValueError) as err:
        run(x, y)
    text = str(err.value)
    assert text.startswith("'split', which strategy='auto' chose (gradient hooks on head.weight:"), text
    assert "Pass strategy" not in text and "Give DDP(..., bucket_cap_mb=1) for one bucket" in text, text
    handle.remove()
    for step in range(3):  # past start_powerSGD_iter: bucketwise's own PowerSGD program
        run(*_batch(step)).backward()
    assert [g.strategy for g in bucketwise.report(run).graphs if g.strategy != "none"] == ["fused"]


def test_batched_hook_is_refused_with_powersgd_named(single_rank_group):
    ddp = _ddp(GPT(CFG), cap_mb=SEVERAL, hook=ps.batched_powerSGD_hook)
    run = bucketwise.compile(ddp, backend="aot_eager")
    with pytest.raises(ValueError, match="Register powerSGD_hook instead"):
        run(*_batch(0))


def test_split_with_one_bucket_trains_as_eager_ddp(single_rank_group):
    torch.manual_seed(0)
    model = GPT(CFG)
    eager = _ddp(copy.deepcopy(model), cap_mb=1)
    run = bucketwise.compile(_ddp(model, cap_mb=1), strategy="split", backend="aot_eager")
    params = dict(model.named_parameters())
    for step in range(4):  # compressed from step 2
        eager(*_batch(step)).backward()
        run(*_batch(step)).backward()
        for name, p in eager.module.named_parameters():
            torch.testing.assert_close(params[name].grad, p.grad, msg=f"step {step}: {name}")
            p.grad = params[name].grad = None
