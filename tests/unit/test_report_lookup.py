"""``bucketwise.report(x)`` finds bucketwise's report through every object a user holds
(NOTE [report finds the compile] in ``stats/report.py``): what ``torch.compile`` returned,
the DDP module, the module compiled inside DDP, a framework's wrapper around them. And an object
bucketwise never compiled raises, naming what was searched.

One rank in this process (a real gloo group and DDP reducer); the frameworks' own wrappers are
checked by their recipes (tests/integrations/scripts/)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import bucketwise

AOT = {"inner_backend": "aot_eager"}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class FrameworkWrapper(nn.Module):
    """Shaped like Lightning Fabric's ``_FabricModule``: what it calls, and what it was given."""

    def __init__(self, forward_module: nn.Module, original_module: nn.Module) -> None:
        super().__init__()
        self._forward_module = forward_module
        self._original_module = original_module

    def forward(self, *args):
        return self._forward_module(*args)

    def __getattr__(self, name: str):
        # like Fabric's: unknown attributes come from the original module
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._original_module, name)


def _step(model: nn.Module, steps: int = 2) -> None:
    for _ in range(steps):
        model(torch.randn(4, 8)).sum().backward()


def test_compile_around_ddp_found_from_every_object(single_rank_group):
    net = Net()
    user_compiled = torch.compile(net, backend="bucketwise", options=AOT)  # what the user holds (Fabric)
    ddp = DDP(net)
    compiled = torch.compile(ddp, backend="bucketwise", options=AOT)  # what Fabric builds from it
    wrapper = FrameworkWrapper(compiled, user_compiled)
    with pytest.raises(TypeError, match="after its first call"):
        bucketwise.report(compiled)  # nothing compiled yet
    _step(wrapper)
    rep = bucketwise.report(compiled)
    assert [g.strategy for g in rep.graphs if g.variant is None] == ["fused"]
    for held in (ddp, net, user_compiled, wrapper):
        assert bucketwise.report(held) is rep, type(held).__name__


def test_compile_inside_ddp_found_from_every_object(single_rank_group):
    net = Net()
    inner = torch.compile(net, backend="bucketwise", options={**AOT, "strategy": "split"})
    ddp = DDP(inner)  # the HF Trainer given model=torch.compile(model)
    _step(ddp, steps=3)
    rep = bucketwise.report(inner)
    assert [g.strategy for g in rep.graphs] == ["split"]
    for held in (ddp, net, FrameworkWrapper(ddp, inner)):
        assert bucketwise.report(held) is rep, type(held).__name__


def test_bucketwise_compile_result_and_function():
    compiled = bucketwise.compile(Net(), backend="aot_eager")
    compiled(torch.randn(4, 8))
    assert bucketwise.report(compiled).graphs
    fn = bucketwise.compile(lambda x: torch.sin(x) * 2, backend="aot_eager")
    fn(torch.randn(3))
    assert bucketwise.report(fn).graphs


def test_uncompiled_object_names_what_was_searched(single_rank_group):
    with pytest.raises(TypeError, match=r"got DistributedDataParallel \(searched: DistributedDataParallel -> Linear\)"):
        bucketwise.report(DDP(nn.Linear(2, 2)))
    with pytest.raises(TypeError, match=r"got int"):
        bucketwise.report(3)


def test_rank_file_rewritten_once_alignment_and_backward_compiles_are_known(single_rank_group, tmp_path, monkeypatch):
    """The path where DDP's own forward runs a module compiled inside it (HF Trainer given a
    compiled model, Lightning Trainer): the rank file is rewritten when the reducer's rebuilt
    buckets make the alignment known and once the lazily compiled backward is recorded."""
    import json

    monkeypatch.setenv("BUCKETWISE_STATS_DIR", str(tmp_path / "stats"))
    inner = torch.compile(Net(), backend="bucketwise", options={**AOT, "strategy": "split"})
    ddp = DDP(inner)
    _step(ddp, steps=4)
    saved = json.loads((tmp_path / "stats" / "rank0.json").read_text())
    live = bucketwise.report(inner).to_dict()
    assert saved["alignment"]["alignment"] == live["alignment"]["alignment"] == 1.0, saved["alignment"]
    assert saved["totals"]["compile_times"]["backward_compiles"] == 1, saved["totals"]["compile_times"]
    assert saved["totals"]["compile_times"] == live["totals"]["compile_times"]


def _decorated(fn):
    """Like transformers' ``deprecate_kwarg``: the wrapper's frame holds the module in ``*args``."""
    import functools

    @functools.wraps(fn)
    def wrapped_func(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapped_func


class DecoratedNet(Net):
    @_decorated
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


def test_decorated_forward_still_compiled_around_ddp(single_rank_group):
    """The compile wraps the DDP module even when the module's forward is a decorator's
    ``wrapped_func(*args, **kwargs)`` (transformers 5.24's LlamaForCausalLM): fused, not split."""
    net = DecoratedNet()
    compiled = torch.compile(DDP(net), backend="bucketwise", options=AOT)
    _step(compiled, steps=2)
    rep = bucketwise.report(compiled)
    assert rep.target == "DDP(DecoratedNet)", rep.target
    assert [g.strategy for g in rep.graphs if g.variant is None] == ["fused"]
    # and compiled inside DDP, report() finds it through the module in the wrapper's *args
    inner = torch.compile(DecoratedNet(), backend="bucketwise", options={**AOT, "strategy": "split"})
    _step(DDP(inner), steps=2)
    assert [g.strategy for g in bucketwise.report(inner).graphs] == ["split"]
