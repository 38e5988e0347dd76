"""``share_blocks="auto"`` (the default) shares identical blocks where bucketwise's CUDA graphs are
on and the strategy is not ``split`` (NOTE [sharing by default]); where it leaves a model's
repeated blocks to the whole graph, the report says so and why. The shared path itself is
checked against eager DDP in tests/distributed/test_shared_blocks.py and, with CUDA graphs, in
tests/gpu/test_gpu_shared_blocks.py."""

from __future__ import annotations

import copy

import pytest
import torch
from support.small_net import BlocksNet as Net

import bucketwise
from bucketwise.compiler.config import CompileConfig
from bucketwise.compiler.decision import decide_sharing

ON_GPU = torch.cuda.is_available()


@pytest.mark.parametrize(
    ("share_blocks", "strategy", "cudagraphs", "enabled", "why"),
    [
        ("auto", "auto", True, True, None),
        ("auto", "fused", True, True, None),
        ("auto", "none", True, True, None),
        ("auto", "split", True, False, "strategy='split'"),
        ("auto", "split", False, False, "strategy='split'"),
        # Without CUDA graphs: estimated per graph on a GPU (NOTE [sharing by cost]).
        ("auto", "fused", False, ON_GPU, None if ON_GPU else "on the CPU each call costs host time"),
        (True, "split", False, True, None),
        (False, "fused", True, False, None),
    ],
)
def test_the_default_shares_where_cuda_graphs_replay_the_blocks(share_blocks, strategy, cudagraphs, enabled, why):
    decision = decide_sharing(CompileConfig(share_blocks=share_blocks, strategy=strategy), cudagraphs=cudagraphs)
    assert decision.enabled is enabled
    # Only the default without CUDA graphs on a GPU is decided by timing the compiled block.
    assert decision.by_cost is (share_blocks == "auto" and strategy != "split" and not cudagraphs and ON_GPU)
    if why is None:
        assert decision.reason is None, decision.reason
    else:
        assert why in decision.reason and "share_blocks=True" in decision.reason, decision.reason
        # Left unshared for host time only where that is the reason (what the runtime view weighs).
        assert decision.host_time is (strategy != "split"), decision


@pytest.mark.parametrize("share_blocks", ["auto", True])
def test_a_backend_blocks_cannot_compile_with_shares_nothing_and_says_why(share_blocks):
    """The one place that knows which backends a shared block compiles with (NOTE [sharing by
    default]): ``eager`` or a callable backend share nothing, even when asked to."""

    def my_backend(gm, example_inputs):
        return gm

    for backend, name in (("eager", "'eager'"), (my_backend, "'my_backend'")):
        config = CompileConfig(share_blocks=share_blocks, backend=backend)
        decision = decide_sharing(config, cudagraphs=True)
        assert not decision.enabled
        assert decision.reason == f"blocks are shared with the backends ['inductor', 'aot_eager'], not {name}"


def test_asked_to_share_with_a_backend_that_cannot_the_report_says_why():
    net, x = Net(), torch.randn(4, 8)
    compiled = bucketwise.compile(net, backend="eager", share_blocks=True)
    compiled(x)
    report = bucketwise.report(compiled)
    (note,) = [n for n in report.notes if "compiled with the whole graph" in n]
    assert note == "blocks: 3 blocks compiled with the whole graph: blocks are shared with the backends " + (
        "['inductor', 'aot_eager'], not 'eager'"
    ), note
    # Not for host time: a profile of a GPU-bound step gives no advice to share them.
    (entry,) = report.to_dict()["unshared_blocks"]
    assert entry["container"] == "blocks" and entry["blocks"] == 3 and entry["host_time"] is False, entry


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_a_bad_share_blocks_value_names_the_choices(bad):
    with pytest.raises(ValueError, match=r"share_blocks must be True, False or 'auto', got"):
        CompileConfig(share_blocks=bad)


def test_blocks_the_default_leaves_unshared_are_named_in_the_report():
    torch.manual_seed(0)
    net, x = Net(), torch.randn(4, 8)
    expected = net(x)
    compiled = bucketwise.compile(net, backend="aot_eager")  # no CUDA graphs here: not shared
    torch.testing.assert_close(compiled(x), expected)
    report = bucketwise.report(compiled)
    (note,) = [n for n in report.notes if "compiled with the whole graph" in n]
    assert note.startswith("blocks: 3 blocks compiled with the whole graph: share_blocks='auto'"), note
    # Left unshared for the host time a shared call costs: what a GPU-bound profile weighs
    # (NOTE [saying when sharing blocks is free]); readers of the rank file see it too. The
    # graph's record gives the same reason (its plan's, NOTE [one plan per graph]).
    (entry,) = report.to_dict()["unshared_blocks"]
    assert (entry["container"], entry["blocks"], entry["host_time"]) == ("blocks", 3, True), entry
    assert [g["shared_blocks"] for g in report.to_dict()["graphs"]] == [{"reason": entry["reason"]}]
    assert report.data().unshared_blocks == (entry,)

    asked = bucketwise.compile(Net(), backend="aot_eager", share_blocks=False)
    asked(x)
    assert not any("compiled with the whole graph" in n for n in bucketwise.report(asked).notes)
    # The same model asked to share does share: the check above can tell the two apart.
    shared = bucketwise.compile(Net(), backend="aot_eager", share_blocks=True)
    shared(x)
    (graph,) = bucketwise.report(shared).to_dict()["graphs"]
    assert graph["shared_blocks"]["compiles"] == 1 and graph["shared_blocks"]["count"] >= 2, graph["shared_blocks"]


@pytest.mark.parametrize("hooked", [False, True])
def test_auto_shares_under_the_strategy_chosen_not_the_one_asked_for(single_rank_group, monkeypatch, hooked):
    """With CUDA graphs on, ``auto`` shares the blocks under ``fused``; where ``auto`` falls back to
    ``split`` (a gradient hook fused cannot reproduce), it does not: Dynamo inlines the blocks and
    the report says why. Gradients as eager DDP's either way."""
    from support.cudagraph_emulator import use_emulated_graphs
    from torch.nn.parallel import DistributedDataParallel as DDP

    use_emulated_graphs(monkeypatch)
    torch.manual_seed(0)
    net = Net()
    ref, model = DDP(copy.deepcopy(net)), DDP(copy.deepcopy(net))
    if hooked:
        for ddp in (ref, model):
            ddp.module.inp.weight.register_hook(lambda g: g * 2)
    compiled = bucketwise.compile(model, cudagraphs=True)
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        compiled(x).backward()
        ref(x).backward()
        for (name, a), b in zip(model.module.named_parameters(), ref.module.parameters()):
            torch.testing.assert_close(a.grad, b.grad, msg=name)
            a.grad = b.grad = None
    report = bucketwise.report(compiled).to_dict()
    shared = [g["shared_blocks"] for g in report["graphs"]]
    strategies = {g["strategy"] for g in report["graphs"]}
    if not hooked:
        assert strategies == {"fused"}, strategies
        assert shared[0]["compiles"] == 1 and shared[0]["count"] >= 2, shared
        return
    assert strategies == {"split"}, strategies
    assert all(s is not None and "under 'split', which strategy='auto' chose" in s["reason"] for s in shared)
    assert any(
        n.startswith("blocks: 3 blocks compiled with the whole graph: share_blocks='auto'") for n in report["notes"]
    )
    # Under split a shared block is never cut: no advice to share, whatever the profile says.
    assert [u["host_time"] for u in report["unshared_blocks"]] == [False], report["unshared_blocks"]
