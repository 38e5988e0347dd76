"""``bucketwise.compile(..., freeze=True | "raise" | "eager")``: compile on the first call only.

After the first call has returned, a call that would compile a new graph (a guard failed, e.g. a
new input shape) raises an error naming the failed guard (``True``/``"raise"``) or runs that frame
eagerly (``"eager"``); the graphs of the first call keep running, and other compiled code in the
process keeps compiling as usual. (``bucketwise.freeze`` itself: tests/unit/test_report.py.)
"""

from __future__ import annotations

import copy

import pytest
import torch
from support.dist import run_distributed
from support.small_net import Net, _unique_graphs
from torch._dynamo.testing import CompileCounter
from torch.nn.parallel import DistributedDataParallel as DDP

import bucketwise

# The guard a new batch size fails (dynamic=False: no automatic dynamic shapes either way).
_GUARD = r"size mismatch at index 0\. expected 2, actual 3"


def fn(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * 2 + 1


def _graphs(compiled) -> int:
    return len(bucketwise.report(compiled).graphs)


# --- freeze=True / "raise" ----------------------------------------------------------------


@pytest.mark.parametrize("freeze", [True, "raise"])
@pytest.mark.parametrize("dynamic", [False, None], ids=["static", "dynamic=None"])
def test_raise_on_new_shape_names_the_guard(freeze, dynamic):
    model = Net()
    compiled = bucketwise.compile(model, backend="aot_eager", freeze=freeze, dynamic=dynamic)
    x2 = torch.randn(2, 8)
    torch.testing.assert_close(compiled(x2), model(x2))  # the warm-up call compiles
    torch.testing.assert_close(compiled(x2), model(x2))  # the same shape: the cached graph
    assert _graphs(compiled) == 1
    before = _unique_graphs()
    with pytest.raises(RuntimeError, match=r"tensor 'args\[0\]' " + _GUARD) as info:
        compiled(torch.randn(3, 8))
    assert "recompile" in str(info.value).lower(), info.value
    assert _unique_graphs() == before and _graphs(compiled) == 1
    # Still usable afterwards with the warm-up shape.
    torch.testing.assert_close(compiled(x2), model(x2))
    assert any("frozen" in n for n in bucketwise.report(compiled).notes)


def test_warm_up_call_compiles_every_graph_it_needs():
    # Freezing happens once the first call has returned: a graph break inside it still
    # compiles both of its graphs.
    def broken(x: torch.Tensor) -> torch.Tensor:
        y = torch.cos(x) + 1
        torch._dynamo.graph_break()
        return torch.sin(y) * 2

    compiled = bucketwise.compile(broken, backend="aot_eager", freeze=True, dynamic=False)
    x = torch.randn(4)
    torch.testing.assert_close(compiled(x), broken(x))
    assert _graphs(compiled) == 2
    torch.testing.assert_close(compiled(x), broken(x))
    with pytest.raises(RuntimeError, match=r"size mismatch at index 0\. expected 4, actual 5"):
        compiled(torch.randn(5))


# --- freeze="eager" -----------------------------------------------------------------------


@pytest.mark.parametrize("dynamic", [False, None], ids=["static", "dynamic=None"])
def test_eager_on_new_shape_matches_uncompiled(dynamic):
    model = Net()
    compiled = bucketwise.compile(model, backend="aot_eager", freeze="eager", dynamic=dynamic)
    compiled(torch.randn(2, 8))
    before = _unique_graphs()
    for n in (3, 5, 2):
        x = torch.randn(n, 8, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        out, ref = compiled(x), model(x_ref)
        torch.testing.assert_close(out, ref)
        out.sum().backward(), ref.sum().backward()
        torch.testing.assert_close(x.grad, x_ref.grad)
    assert _unique_graphs() == before, "no new graph may be compiled once frozen"
    assert _graphs(compiled) == 1


# --- compiled functions -------------------------------------------------------------------


def test_function_freeze_raise():
    compiled = bucketwise.compile(fn, backend="aot_eager", freeze=True, dynamic=False)
    x = torch.randn(2)
    torch.testing.assert_close(compiled(x), fn(x))
    before = _unique_graphs()
    with pytest.raises(RuntimeError, match=r"tensor 'x' " + _GUARD):
        compiled(torch.randn(3))
    assert _unique_graphs() == before and _graphs(compiled) == 1
    torch.testing.assert_close(compiled(x), fn(x))


def test_function_freeze_eager():
    compiled = bucketwise.compile(fn, backend="aot_eager", freeze="eager", dynamic=False)
    compiled(torch.randn(2))
    before = _unique_graphs()
    x = torch.randn(3)
    torch.testing.assert_close(compiled(x), fn(x))
    assert _unique_graphs() == before and _graphs(compiled) == 1


# --- other compiled code is not frozen ------------------------------------------------------


@pytest.mark.parametrize("freeze", [True, "eager"])
@pytest.mark.parametrize("kind", ["module", "function"])
def test_users_own_torch_compile_still_recompiles(freeze, kind):
    target = Net() if kind == "module" else (lambda x: fn(x).sum(dim=-1))
    compiled = bucketwise.compile(target, backend="aot_eager", freeze=freeze, dynamic=False)
    compiled(torch.randn(2, 8))  # now frozen
    counter = CompileCounter()
    mine = torch.compile(lambda t: torch.cos(t) * 3, backend=counter, dynamic=False)
    mine(torch.ones(2))
    try:
        compiled(torch.randn(3, 8))  # refused or run eagerly: either way the stance is undone
    except RuntimeError:
        assert freeze is True
    mine(torch.ones(3))  # a recompile, as usual
    mine(torch.ones(4))
    assert counter.frame_count == 3
    # And a fresh bucketwise object without freeze compiles as many graphs as it needs.
    other = bucketwise.compile(lambda x: torch.tanh(x), backend="aot_eager", dynamic=False)
    other(torch.ones(2)), other(torch.ones(3))
    assert _graphs(other) == 2


# --- bad values -----------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["yes", 1, 0, "Raise"], ids=["yes", "1", "0", "Raise"])
@pytest.mark.parametrize("kind", ["module", "ddp", "function"])
def test_bad_freeze_value(request, kind, value):
    if kind == "ddp":
        request.getfixturevalue("single_rank_group")
    target = {"module": Net, "ddp": lambda: DDP(Net()), "function": lambda: fn}[kind]()
    before = _unique_graphs()
    with pytest.raises(ValueError, match=r"^freeze must be False, True, 'raise' or 'eager', got ") as info:
        bucketwise.compile(target, backend="aot_eager", freeze=value)
    assert repr(value) in str(info.value)
    assert _unique_graphs() == before
    assert not hasattr(target, "_bucketwise_report")


# --- DDP ----------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["auto", "split"])
def test_ddp_freeze_raise(single_rank_group, strategy):
    torch.manual_seed(0)
    net = Net()
    ref, ddp = DDP(copy.deepcopy(net)), DDP(net)
    compiled = bucketwise.compile(ddp, backend="aot_eager", strategy=strategy, freeze=True, dynamic=False)
    x2 = torch.randn(2, 8)
    for _ in range(2):
        compiled(x2).sum().backward()
    assert _graphs(compiled) == 1
    with pytest.raises(RuntimeError, match=_GUARD):
        compiled(torch.randn(3, 8))
    # A refused call leaves the module usable: the next step still matches eager DDP.
    for m in (compiled, ref):
        m.zero_grad()
        m(x2).sum().backward()
    for p, q in zip(ddp.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    assert _graphs(compiled) == 1


def test_ddp_freeze_raise_then_no_sync_fused(single_rank_group):
    compiled = bucketwise.compile(DDP(Net()), backend="aot_eager", strategy="fused", freeze=True)
    compiled(torch.randn(2, 8)).sum().backward()
    # The no_sync() variant is bucketwise's own: its first call compiles even when frozen...
    for _ in range(2):
        with compiled.no_sync():
            compiled(torch.randn(2, 8)).sum().backward()
    # ...and only its first: a new shape is still refused.
    with pytest.raises(RuntimeError, match="size mismatch|recompile"):
        with compiled.no_sync():
            compiled(torch.randn(3, 8)).sum().backward()


def _eager_step_grads_differ(rank: int, world: int, strategy: str) -> list[float]:
    torch.manual_seed(0)
    net = Net()
    ref, ddp = DDP(copy.deepcopy(net)), DDP(net)
    compiled = bucketwise.compile(ddp, backend="aot_eager", strategy=strategy, freeze="eager", dynamic=False)
    torch.manual_seed(1 + rank)  # different data per rank: the gradients must be averaged
    diffs = []
    for n in (2, 3, 2):  # the 3-row step runs eagerly
        x = torch.randn(n, 8)
        for m in (compiled, ref):
            m.zero_grad()
            m(x).sum().backward()
        diffs.append(max((p.grad - q.grad).abs().max().item() for p, q in zip(ddp.parameters(), ref.parameters())))
    return diffs


@pytest.mark.parametrize(
    "strategy",
    [
        "split",
        "fused",  # the frame run eagerly reduces its gradients after the backward
    ],
)
def test_ddp_freeze_eager_step_matches_eager_ddp_on_2_ranks(tmp_path, strategy):
    for diffs in run_distributed(_eager_step_grads_differ, tmp_path, args=(strategy,), timeout=90):
        assert max(diffs) < 1e-5, diffs
