"""Gradients exist once under ``fused``: DDP's idle bucket buffers are released.

NOTE [released reducer] (distributed/ddpc.py): once ``fused`` is confirmed, DDP's reducer
and its bucket buffers (a second copy of every gradient) are destroyed; ``param.grad`` views the
bucket buffers the compiled backward reduces into, and the reducer is rebuilt only where
something needs it. Every case here trains eager DDP and ``fused`` side by side on 2 gloo ranks
and compares gradients and parameters at every step, under what users do with gradients:
``zero_grad(set_to_none=False)``, clipping, accumulation under ``no_sync()``, an optimizer that
replaces ``.grad``, a checkpoint restored into a new compiled model, ``join()`` with a comm hook
after the reducer was released, DDP's logging data read mid-training.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from support.dist import run_distributed
from torch.nn.parallel import DistributedDataParallel as DDP

from bucketwise._compat import released_reducer

RTOL, ATOL = 1e-5, 1e-6
CAP_MB = 0.01  # 10 KiB buckets: several per graph


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in [(32, 64), (64, 64), (64, 64), (64, 8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            x = F.gelu(x) if i < len(self.layers) - 1 else x
        return x


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(8, 32, generator=torch.Generator().manual_seed(1000 * rank + step))


def _loss(model: Any, x: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), torch.tanh(x[:, :8] * 3.0))


def _close(what: str, actual: Any, expected: Any) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def _bucket_storages(compiled: Any) -> list[set[int]]:
    """Per bucket of the report, the storages its parameters' gradients live in."""
    import bucketwise

    named = dict(compiled.module.named_parameters())
    out = []
    for graph in bucketwise.report(compiled).to_dict()["graphs"]:
        for bucket in graph["buckets"]:
            out.append({named[n].grad.untyped_storage().data_ptr() for n in bucket["params"]})
    return out


def _new_compiled(module: nn.Module) -> Any:
    import bucketwise

    return bucketwise.compile(DDP(module, bucket_cap_mb=CAP_MB), backend="aot_eager", strategy="fused")


def _train(rank: int, world: int, scenario: str) -> dict[str, Any]:

    torch.manual_seed(0)
    base = MLP()
    ref = DDP(copy.deepcopy(base), bucket_cap_mb=CAP_MB)
    cmp_module = copy.deepcopy(base)
    compiled = _new_compiled(cmp_module)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    cmp_opt = torch.optim.SGD(cmp_module.parameters(), lr=0.05, momentum=0.9)
    micro = 3 if scenario == "accumulate" else 1
    out: dict[str, Any] = {"released": [], "storages": []}
    for step in range(5):
        if scenario == "checkpoint" and step == 2:
            # Save, then go on in a new compiled model built from the saved state.
            state, opt_state = copy.deepcopy(compiled.state_dict()), copy.deepcopy(cmp_opt.state_dict())
            cmp_module = MLP()
            compiled = _new_compiled(cmp_module)
            compiled.load_state_dict(state)
            cmp_opt = torch.optim.SGD(cmp_module.parameters(), lr=0.05, momentum=0.9)
            cmp_opt.load_state_dict(opt_state)
        if scenario == "logging_data" and step == 2:
            # Reading DDP's logging data rebuilds the released reducer; the next step releases it again.
            assert compiled._get_ddp_logging_data()["world_size"] == world
            out["rebuilt_for_logging"] = not released_reducer.reducer_released(compiled)
        for k in range(micro):
            x = _batch(rank, step * micro + k)
            for model in (ref, compiled):
                with model.no_sync() if k < micro - 1 else contextlib.nullcontext():
                    _loss(model, x).backward()
        out["released"].append(released_reducer.reducer_released(compiled))
        if scenario == "bucket_views":
            out["storages"].append([len(s) for s in _bucket_storages(compiled)])
        for (name, p), q in zip(ref.module.named_parameters(), cmp_module.parameters()):
            _close(f"step {step} grad of {name}", q.grad, p.grad)
        if scenario == "clip":
            norms = [torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05) for m in (ref, cmp_module)]
            _close(f"step {step} grad norm", norms[1], norms[0])
        if scenario == "replace_grad":
            # An optimizer that hands .grad a new tensor (gradient transforms, some fused optimizers).
            for m in (ref.module, cmp_module):
                for p in m.parameters():
                    p.grad = p.grad * 0.5
        ref_opt.step()
        cmp_opt.step()
        for (name, p), q in zip(ref.module.named_parameters(), cmp_module.parameters()):
            _close(f"step {step} {name}", q.detach(), p.detach())
        keep = scenario in ("keep_grads", "replace_grad")
        ref_opt.zero_grad(set_to_none=not keep)
        cmp_opt.zero_grad(set_to_none=not keep)
    return out


@pytest.mark.parametrize(
    "scenario", ["bucket_views", "keep_grads", "clip", "accumulate", "replace_grad", "checkpoint", "logging_data"]
)
def test_fused_releases_reducer_and_trains_like_eager_ddp(tmp_path, scenario):
    for r in run_distributed(_train, tmp_path, args=(scenario,)):
        # Released from the first step on (again after the logging-data read rebuilt it).
        assert all(r["released"]), r["released"]
        if scenario == "logging_data":
            assert r["rebuilt_for_logging"]
        if scenario == "bucket_views":
            # Each bucket's gradients are views of one buffer: one storage per bucket, every step.
            assert all(counts == [1] * len(counts) for counts in r["storages"]), r["storages"]
            assert len(r["storages"][0]) >= 3


def _join_with_hook(rank: int, world: int) -> dict[str, Any]:
    """Uneven inputs inside ``join()`` with torch's fp16 hook: once rank 1 has joined, rank 0's
    steps need DDP's reducer, which bucketwise released at the first step and rebuilds with the
    hook registered on it."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import bucketwise

    torch.manual_seed(0)
    base = MLP()
    ref = DDP(copy.deepcopy(base), bucket_cap_mb=CAP_MB)
    ddp = DDP(copy.deepcopy(base), bucket_cap_mb=CAP_MB)
    for m in (ref, ddp):
        m.register_comm_hook(None, default_hooks.fp16_compress_hook)
    compiled = bucketwise.compile(ddp, backend="aot_eager", strategy="fused")
    records: dict[str, list[Any]] = {"ref": [], "cmp": []}
    states = []
    for name, model, module in (("ref", ref, ref), ("cmp", compiled, ddp)):
        opt = torch.optim.SGD(module.parameters(), lr=0.05)
        with module.join():
            for step in range(4 - 2 * rank):
                _loss(model, _batch(rank, step)).backward()
                records[name].append([p.grad.clone() for p in module.parameters()])
                opt.step()
                opt.zero_grad(set_to_none=True)
                states.append(released_reducer.reducer_released(ddp)) if name == "cmp" else None
        records[name].append([p.detach().clone() for p in module.parameters()])
    for step, (a, b) in enumerate(zip(records["ref"], records["cmp"])):
        for i, (x, y) in enumerate(zip(a, b)):
            torch.testing.assert_close(
                y, x, rtol=1e-3, atol=1e-4, msg=lambda m: f"rank {rank} record {step} tensor {i}: {m}"
            )
    hooked = ddp._get_ddp_logging_data().get("comm_hook")
    return {"released": states, "hook": hooked, "reducer": type(ddp.reducer).__name__}


def test_join_rebuilds_released_reducer_with_its_comm_hook(tmp_path):
    rank0, rank1 = run_distributed(_join_with_hook, tmp_path)
    # Rank 1 joins after 2 steps; rank 0's last 2 steps run with the rebuilt reducer.
    assert rank0["released"] == [True, True, False, False], rank0
    assert rank1["released"] == [True, True], rank1
    for r in (rank0, rank1):
        assert r["hook"] == "fp16_compress_hook" and r["reducer"] == "Reducer", r


def test_release_frees_the_bucket_buffers(single_rank_group):
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("build"):
            ddp = DDP(MLP(), bucket_cap_mb=CAP_MB)
        with record_function("release"):
            freed = released_reducer.release_reducer(ddp)
    expected = sum(p.numel() * p.element_size() for p in ddp.parameters())
    assert freed == expected
    released = [e.cpu_memory_usage for e in prof.events() if e.name == "release"]
    assert released == [-expected], released
    assert released_reducer.release_reducer(ddp) == 0  # nothing left to release
    assert dist.get_world_size() == 1
