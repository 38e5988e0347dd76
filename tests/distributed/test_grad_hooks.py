"""Hooks on the gradient path keep eager DDP's semantics under every strategy, across 2 real ranks.

Each case trains an eager ``DDP`` model and a ``bucketwise.compile``d copy side by side on
rank-specific batches, with the same hooks on both, and compares every gradient after each
backward (after DDP's reduction) and every parameter after each SGD step. The hooks are not
linear (a clamp, a per-rank scale, a square root of a module's gradient), so a hook that runs
after the reduction instead of before it gives another result (NOTE [gradient hooks before the
reduction]). "late" cases register the hooks after two steps, on a model already compiled
(NOTE [hooks registered after compile]); one case removes them again. All cases of a test run
in one pair of processes.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from support.dist import run_distributed
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = 5
LATE_AT = 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 32)
        self.c = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _clamp_grad(p: torch.Tensor) -> None:
    p.grad.clamp_(-0.02, 0.02)


def _signed_sqrt(t: torch.Tensor) -> torch.Tensor:
    return t.sign() * t.abs().sqrt()


def _add_hooks(model: Net, kind: str, rank: int) -> list:
    """The hooks of ``kind`` on ``model``; returns their handles."""
    params = list(model.parameters())
    if kind == "tensor_clamp":
        return [p.register_hook(lambda g: g.clamp(-0.02, 0.02)) for p in params]
    if kind == "tensor_rank_scale":  # linear in the gradient, but differs per rank
        return [p.register_hook(lambda g, s=1.0 + rank: g * s) for p in params]
    if kind == "tensor_half":  # linear and equal on every rank: any order gives the same result
        return [p.register_hook(lambda g: g * 0.5) for p in params]
    if kind == "post_accumulate_clamp":
        return [p.register_post_accumulate_grad_hook(_clamp_grad) for p in params]
    if kind == "module_backward":
        return [model.b.register_full_backward_hook(lambda m, gi, go: (_signed_sqrt(gi[0]),))]
    if kind == "module_backward_pre":
        return [model.b.register_full_backward_pre_hook(lambda m, go: (_signed_sqrt(go[0]),))]
    if kind == "module_forward":
        return [model.b.register_forward_hook(lambda m, args, out: _signed_sqrt(out))]
    raise AssertionError(f"expected a hook kind, got {kind!r}")


def _train_pair(rank: int, kind: str, strategy: str, when: str) -> dict:
    """Eager DDP and bucketwise side by side; ``when``: ``early`` (hooks before compile),
    ``late`` (after step LATE_AT), ``removed`` (early, removed after step LATE_AT). Where the
    hooks refuse an explicit strategy (NOTE [explicit strategies]), ``refused`` holds the errors:
    at ``compile``, or at the step (two calls: the refusal holds while the hooks are there); the
    hooks are then removed from both models, and training goes on without them."""
    import bucketwise

    torch.manual_seed(0)
    base = Net()
    eager_net, compiled_net = copy.deepcopy(base), copy.deepcopy(base)
    handles = []
    if when in ("early", "removed"):
        handles = _add_hooks(eager_net, kind, rank) + _add_hooks(compiled_net, kind, rank)
    eager = DDP(eager_net)
    try:
        compiled = bucketwise.compile(DDP(compiled_net), backend="aot_eager", strategy=strategy)
    except ValueError as exc:
        return {"refused": {"compile": [str(exc)]}}
    refused = {}
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (eager_net, compiled_net)]
    worst = 0.0
    for step in range(STEPS):
        if step == LATE_AT and when == "late":
            handles = _add_hooks(eager_net, kind, rank) + _add_hooks(compiled_net, kind, rank)
        if step == LATE_AT and when == "removed":
            for h in handles:
                h.remove()
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * step + rank))
        eager(x).pow(2).mean().backward()
        try:
            compiled(x).pow(2).mean().backward()
        except ValueError as exc:
            refused[step] = [str(exc)]
            try:
                compiled(x)
            except ValueError as again:
                refused[step].append(str(again))
            for h in handles:
                h.remove()
            for opt in opts:
                opt.zero_grad()
            continue
        for p, q in zip(eager_net.parameters(), compiled_net.parameters()):
            worst = max(worst, (p.grad - q.grad).abs().max().item())
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for p, q in zip(eager_net.parameters(), compiled_net.parameters()):
        worst = max(worst, (p - q).abs().max().item())
    rep = bucketwise.report(compiled)
    return {
        "worst": worst,
        "strategies": [g.strategy for g in rep.graphs],
        "reasons": [g.strategy_reason for g in rep.graphs],
        "notes": list(rep.notes),
        "refused": refused,
    }


def _cases(rank: int, world: int, cases: list[tuple[str, str, str]]) -> dict:
    return {case: _train_pair(rank, *case) for case in cases}


def _run(tmp_path, cases: list[tuple[str, str, str]]) -> dict:
    r0, r1 = run_distributed(_cases, tmp_path, args=(cases,), timeout=600)
    assert r0.keys() == r1.keys()
    return r0


GRADIENT_HOOKS = ("tensor_clamp", "tensor_rank_scale", "post_accumulate_clamp")


def test_gradient_hooks_run_before_the_reduction_under_every_strategy(tmp_path):
    cases = [
        (kind, strategy, when)
        for kind in GRADIENT_HOOKS
        for strategy in ("auto", "fused", "split", "none")
        for when in ("early", "late")
    ]
    results = _run(tmp_path, cases)
    for (kind, strategy, when), r in results.items():
        if strategy == "fused":
            # fused cannot run a hook before its in-graph reduction: asked for explicitly, it
            # raises, naming the hooks and strategy='auto' (NOTE [explicit strategies]).
            errors = r["refused"].get("compile" if when == "early" else LATE_AT)
            assert errors, (kind, when, r)
            for e in errors:
                assert e.startswith("strategy='fused' cannot apply to DDP(Net): gradient hooks on a.weight"), e
                assert "Pass strategy='auto', which runs 'split' here" in e, e
            if when == "early":
                continue
            assert len(errors) == 2 and set(r["refused"]) == {LATE_AT}, r["refused"]
            # nothing half-built: once the hooks are gone it trains on, fused, as eager DDP
            assert set(r["strategies"]) == {"fused"}, r
        assert r["worst"] <= 1e-6, f"{kind} {strategy} {when}: differs from eager DDP by {r['worst']:.3g}"
        if strategy == "auto":
            # fused cannot run a hook before its in-graph reduction: split, with the reason.
            assert r["strategies"][-1] == "split", (kind, strategy, when, r)
            assert "gradient hooks on" in r["reasons"][-1], r["reasons"]
        if when == "late" and strategy == "auto":
            assert r["strategies"][0] == "fused", r
            assert any("hooks added on" in n and "compiled again" in n for n in r["notes"]), r["notes"]


def test_fused_comes_back_once_the_gradient_hooks_are_removed(tmp_path):
    results = _run(tmp_path, [("tensor_clamp", "auto", "removed"), ("tensor_half", "auto", "early")])
    removed = results[("tensor_clamp", "auto", "removed")]
    assert removed["worst"] <= 1e-6, removed
    assert removed["strategies"][0] == "split" and removed["strategies"][-1] == "fused", removed
    assert any("strategy split -> fused" in n for n in removed["notes"]), removed["notes"]
    # A hook that is linear and the same on every rank is still a hook DDP runs first: split.
    half = results[("tensor_half", "auto", "early")]
    assert half["worst"] <= 1e-6 and half["strategies"] == ["split"], half


@pytest.mark.parametrize("strategy", ["auto", "split"])
def test_module_hooks_registered_after_compile_take_effect(tmp_path, strategy):
    # Dynamo does not guard on module hooks: without the hook watch the compiled graphs kept
    # running without them. Module backward hooks act on activations' gradients: fused stays.
    kinds = ("module_backward", "module_backward_pre", "module_forward")
    results = _run(tmp_path, [(kind, strategy, when) for kind in kinds for when in ("early", "late")])
    for (kind, _, when), r in results.items():
        assert r["worst"] <= 1e-6, f"{kind} {when}: differs from eager DDP by {r['worst']:.3g}"
        expected = "fused" if strategy == "auto" else "split"
        assert set(r["strategies"]) == {expected}, (kind, when, r)
        if when == "late":
            assert any("hooks added on b (" in n for n in r["notes"]), r["notes"]
