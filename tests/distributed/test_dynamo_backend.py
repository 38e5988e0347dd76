"""``torch.compile(..., backend="bucketwise")``: the registered backend.

The entry point is found by name in a fresh interpreter that has not imported bucketwise; its
options are checked; on 2 gloo ranks both ways of nesting ``torch.compile`` and ``DDP`` train
exactly like eager DDP, with bucketwise's strategy (NOTE [registered backend takes over the DDP
forward] and NOTE [compiled inside DDP] in ``compiler/dynamo_backend.py``).
"""

from __future__ import annotations

import copy
import importlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
from support.dist import run_distributed
from support.entry_point import declared_entry_points, entry_point_dir
from torch.nn.parallel import DistributedDataParallel as DDP

from bucketwise.compiler.dynamo_backend import OWN_OPTIONS, bucketwise_backend, config_from_options

AOT = {"inner_backend": "aot_eager"}


def test_entry_point_declared_and_resolves():
    declared = declared_entry_points()
    assert declared == {"bucketwise": "bucketwise.compiler.dynamo_backend:bucketwise_backend"}, declared
    module, _, name = declared["bucketwise"].partition(":")
    assert getattr(importlib.import_module(module), name) is bucketwise_backend


def test_backend_found_by_name_without_importing_bucketwise(tmp_path):
    script = textwrap.dedent(
        """
        import sys, warnings, torch
        assert "bucketwise" in torch.compiler.list_backends(), torch.compiler.list_backends()
        assert "bucketwise" not in sys.modules
        f = torch.compile(lambda x: torch.sin(x) + 1, backend="bucketwise", options={"inner_backend": "aot_eager"})
        x = torch.randn(8)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            y = f(x)
        torch.testing.assert_close(y, torch.sin(x) + 1)
        assert "bucketwise" in sys.modules
        print("NOTE:", [str(w.message) for w in caught if "bucketwise" in str(w.message)][0])
        """
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(entry_point_dir(tmp_path))] + [p for p in sys.path if p])
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "no DistributedDataParallel forward" in out.stdout and "inner backend" in out.stdout, out.stdout


def test_module_without_ddp_has_a_report():
    """One process, no DDP (a framework's single-device run): the model trains as eager does,
    each graph compiled whole, and report() finds what was compiled through torch.compile's object."""
    import warnings

    import bucketwise

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="bucketwise", options={**AOT, "strategy": "split"})
    x = torch.randn(5, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(x).square().sum().backward()
    assert any("no DistributedDataParallel forward" in str(w.message) for w in caught), [str(w.message) for w in caught]
    reference(x).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    rep = bucketwise.report(compiled)
    assert rep is bucketwise.report(model)
    assert [g.strategy for g in rep.graphs] == ["none"], rep.graphs
    (segment,) = rep.graphs[0].segments
    assert segment.backend == "aot_eager" and segment.op_count >= 3 and rep.graph_runs == 1, segment
    assert any("no DDP forward running" in n for n in rep.notes), rep.notes
    # A second call reuses the compiled graph: no second report, no recompile.
    compiled(x)
    assert bucketwise.report(compiled) is rep and len(rep.graphs) == 1 and rep.graph_runs == 2


def test_a_refused_attach_leaves_nothing_on_the_ddp_module(single_rank_group):
    """An explicit ``fused`` refused at the first call (a gradient hook): the error names the
    reason, and the DDP module keeps no hook of the attach, so fixing the cause and compiling
    again starts clean."""
    torch._dynamo.reset()
    ddp = DDP(Net())
    handle = next(iter(ddp.module.parameters())).register_hook(lambda g: g)
    compiled = torch.compile(ddp, backend="bucketwise", options={**AOT, "strategy": "fused"})
    with pytest.raises(Exception, match="gradient hooks on"):
        compiled(torch.randn(2, 256))
    assert not ddp._forward_pre_hooks and not ddp._forward_hooks, (ddp._forward_pre_hooks, ddp._forward_hooks)
    handle.remove()
    torch._dynamo.reset()


def test_options():
    config = config_from_options(None, {"strategy": "split", "inner_backend": "aot_eager", "bucket_cap_mb": 2}, None)
    assert (config.strategy, config.backend, config.bucket_cap_mb, config.options) == ("split", "aot_eager", 2, None)
    # Inductor options pass through to Inductor; mode and dynamic act as for torch.compile.
    config = config_from_options(None, {"cudagraphs": "auto", "max_autotune": True}, True)
    assert (config.backend, config.options, config.cudagraphs, config.dynamic) == (
        "inductor",
        {"max_autotune": True},
        "auto",
        True,
    )
    assert config_from_options("max-autotune", None, None).mode == "max-autotune"
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['stratgy'\].*'strategy'.*Inductor"):
        config_from_options(None, {"stratgy": "split"}, None)
    with pytest.raises(ValueError, match=r"\['max_autotune'\].*inner_backend='aot_eager' takes no other options"):
        config_from_options(None, {"inner_backend": "aot_eager", "max_autotune": True}, None)
    with pytest.raises(ValueError, match="unknown strategy 'fast'"):
        config_from_options(None, {"strategy": "fast"}, None)
    with pytest.raises(ValueError, match="inner_backend cannot be 'bucketwise'"):
        config_from_options(None, {"inner_backend": "bucketwise"}, None)
    assert "strategy" in OWN_OPTIONS and "inner_backend" in OWN_OPTIONS


@pytest.mark.parametrize("dynamic", [True, False, None])
def test_dynamic_seen_by_the_backend(dynamic):
    """torch.compile does not pass dynamic= to a backend; bucketwise reads it from the Dynamo
    config torch.compile patches around its calls."""
    from bucketwise._compat import dynamo as dc

    seen = []

    def spy(gm, example_inputs):
        seen.append(dc.requested_dynamic())
        return gm.forward

    torch.compile(lambda x: x * 2, backend=spy, dynamic=dynamic)(torch.randn(4))
    assert seen == [dynamic], seen


# --- 2 ranks ---------------------------------------------------------------------------------


class Net(nn.Module):
    """6 layers of 257 KiB: with DDP's default caps, 2 buckets (the first closes at 1 MiB)."""

    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(256, 256) for _ in range(6))
        self.unused = nn.Linear(4, 4) if unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = Net()
        self.head = nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _train(model, params, rank: int, steps: int = 3, no_sync_first: bool = False) -> None:
    opt = torch.optim.SGD(params, lr=0.05)
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 * step + rank)
        if no_sync_first:
            with model.no_sync():
                model(torch.randn(8, 256, generator=gen)).pow(2).mean().backward()
        model(torch.randn(8, 256, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def _worker(rank: int, world: int, ep_dir: str) -> dict:
    sys.path.insert(0, ep_dir)
    import bucketwise

    out = {}
    torch.manual_seed(0)
    base = Net()

    # compile wraps DDP (accelerate, Lightning Fabric), with a no_sync() micro-step per step.
    eager, net = copy.deepcopy(base), copy.deepcopy(base)
    _train(DDP(eager), eager.parameters(), rank, no_sync_first=True)
    compiled = torch.compile(DDP(net), backend="bucketwise", options=AOT)
    _train(compiled, net.parameters(), rank, no_sync_first=True)
    rep = bucketwise.report(compiled)
    out["outer"] = (
        _max_diff(eager, net),
        [(g.strategy, g.variant) for g in rep.graphs],
        len(rep.graphs[0].buckets),
        rep.notes,
    )

    # DDP wraps the compiled module (HF Trainer given model=torch.compile(model)).
    eager, net = copy.deepcopy(base), copy.deepcopy(base)
    _train(DDP(eager), eager.parameters(), rank)
    inner = torch.compile(net, backend="bucketwise", options={**AOT, "strategy": "split"})
    _train(DDP(inner), net.parameters(), rank)
    rep = bucketwise.report(inner)
    out["inner"] = (_max_diff(eager, net), [g.strategy for g in rep.graphs], len(rep.graphs[0].segments))

    # find_unused_parameters=True (accelerate's default for a PreTrainedModel): auto picks split.
    base = Net(unused=True)
    eager, net = copy.deepcopy(base), copy.deepcopy(base)
    _train(DDP(eager, find_unused_parameters=True), eager.parameters(), rank)
    compiled = torch.compile(DDP(net, find_unused_parameters=True), backend="bucketwise", options=AOT)
    _train(compiled, net.parameters(), rank)
    rep = bucketwise.report(compiled._orig_mod)
    out["unused"] = (_max_diff(eager, net), [(g.strategy, g.strategy_reason) for g in rep.graphs])

    # A module compiled inside the module DDP wraps (a LightningModule's network): split, whole graphs.
    base = Outer()
    eager, net = copy.deepcopy(base), copy.deepcopy(base)
    _train(DDP(eager), eager.parameters(), rank, steps=4)
    net.body = torch.compile(net.body, backend="bucketwise", options=AOT)
    _train(DDP(net), net.parameters(), rank, steps=4)
    rep = bucketwise.report(net.body)
    assert bucketwise.report(copy.deepcopy(net.body)) is rep  # a copy (EMA, evaluation) shares the report
    out["deep"] = (_max_diff(eager, net), [(g.strategy, g.op_count) for g in rep.graphs])
    return out


def test_compile_and_ddp_either_way_train_like_eager_ddp(tmp_path):
    results = run_distributed(_worker, tmp_path, args=(str(entry_point_dir(tmp_path)),))
    for rank, out in enumerate(results):
        diff, graphs, buckets, notes = out["outer"]
        # fused averages each micro-step's gradients in the backward (DDP: once, after no_sync)
        assert diff < 2e-5, (rank, diff)
        # auto -> fused, plus the no_sync() variant (no collectives), each compiled once.
        assert sorted(graphs, key=str) == [("fused", None), ("none", "no_sync")], graphs
        # One bucket: the fused default sizes its own (NOTE [fused bucket sizes]), and this model is
        # under DDP's 25 MiB (DDP's 1 MiB first bucket would make two).
        assert buckets == 1, buckets
        assert any("the first call ran uncompiled" in n for n in notes), notes

        diff, strategies, segments = out["inner"]
        assert diff < 1e-6, (rank, diff)
        assert strategies == ["split"] and segments == 2, (strategies, segments)

        diff, graphs = out["unused"]
        assert diff < 1e-6, (rank, diff)
        assert [s for s, _ in graphs] == ["split"] and "find_unused_parameters=True" in graphs[0][1], graphs

        diff, graphs = out["deep"]
        assert diff < 1e-6, (rank, diff)
        # one whole graph of the 6 layers (torch's DDPOptimizer would have handed over pieces)
        assert len(graphs) == 1 and graphs[0][0] == "split" and graphs[0][1] >= 12, graphs
