"""bucketwise.compile rejects bad arguments up front, with the argument named, and compiles
nothing; soft options that cannot apply (cudagraphs on CPU) only warn. Also: DDP's own errors
for a bad DDP (raised before bucketwise sees the model), and ranks that disagree (process
groups of different sizes, different strategies or bucket caps per rank) on 2 gloo processes.
Each row of the error table in docs/troubleshooting.md has a test here."""

from __future__ import annotations

import datetime
import logging
import math
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from support.dist import run_distributed
from support.small_net import Net, _unique_graphs
from torch.nn.parallel import DistributedDataParallel as DDP

import bucketwise


def _assert_nothing_compiled(before: int, *objs) -> None:
    assert _unique_graphs() == before, "a rejected compile must not capture any graph"
    for obj in objs:
        assert not hasattr(obj, "_bucketwise_report")


@pytest.fixture
def ddp_model(single_rank_group):
    return DDP(Net())


@pytest.mark.parametrize("obj", [42, "model", None, [nn.Linear(2, 2)]], ids=["int", "str", "None", "list"])
def test_non_callable_obj(obj):
    before = _unique_graphs()
    with pytest.raises(TypeError, match=r"\bobj\b") as info:
        bucketwise.compile(obj, backend="aot_eager")
    assert type(obj).__name__ in str(info.value)
    _assert_nothing_compiled(before)


def _check_rejected(target, exc_type, name: str, accepted: list[str], **kwargs) -> str:
    before = _unique_graphs()
    with pytest.raises(exc_type) as info:
        bucketwise.compile(target, **kwargs)
    msg = str(info.value)
    assert name in msg, f"the message must name {name!r}: {msg}"
    for value in accepted:
        assert value in msg, f"the message must list {value!r}: {msg}"
    _assert_nothing_compiled(before, target)
    # The module is untouched and still runs eagerly.
    x = torch.randn(2, 8)
    if isinstance(target, nn.Module):
        target(x)
    assert _unique_graphs() == before
    return msg


@pytest.mark.parametrize("name", ["no_such_backend", "inductr"])
@pytest.mark.parametrize("use_ddp", [True, False], ids=["ddp", "module"])
def test_unknown_backend(request, use_ddp, name):
    target = request.getfixturevalue("ddp_model") if use_ddp else Net()
    _check_rejected(target, ValueError, "backend", [f"'{name}'", "inductor", "aot_eager", "eager"], backend=name)


def test_non_callable_backend():
    _check_rejected(Net(), TypeError, "backend", [], backend=3)


@pytest.mark.parametrize("name", ["bucketed", "fast"])
@pytest.mark.parametrize("use_ddp", [True, False], ids=["ddp", "module"])
def test_unknown_strategy(request, use_ddp, name):
    target = request.getfixturevalue("ddp_model") if use_ddp else Net()
    _check_rejected(
        target, ValueError, "strategy", [f"'{name}'", "split", "none", "auto"], backend="aot_eager", strategy=name
    )


# -- an explicit strategy that cannot apply (NOTE [explicit strategies]) ----------------------------


@pytest.mark.parametrize("strategy", ["fused", "split"])
def test_explicit_strategy_needs_a_ddp_module(strategy):
    msg = _check_rejected(
        Net(),
        ValueError,
        f"strategy={strategy!r}",
        ["DistributedDataParallel", "strategy='auto'"],
        backend="aot_eager",
        strategy=strategy,
    )
    assert "Net is not one" in msg, msg
    for fine in ("auto", "none"):  # auto falls back (the report says why), none asked for it
        compiled = bucketwise.compile(Net(), backend="aot_eager", strategy=fine)
        _step(compiled)
        assert [g.strategy for g in bucketwise.report(compiled).graphs] == ["none"]


def _custom_hook(state, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


@pytest.mark.parametrize("when", ["before", "after"])
def test_explicit_fused_with_a_comm_hook_it_cannot_trace(single_rank_group, when):
    ddp = DDP(Net())
    if when == "before":
        ddp.register_comm_hook(None, _custom_hook)
        msg = _check_rejected(
            ddp, ValueError, "strategy='fused'", ["_custom_hook", "strategy='auto'"], strategy="fused"
        )
    else:  # known at the first call: it raises there, before anything is compiled
        before = _unique_graphs()
        compiled = bucketwise.compile(ddp, backend="aot_eager", strategy="fused")
        ddp.register_comm_hook(None, _custom_hook)
        for _ in range(2):  # and at every call while the hook is there
            with pytest.raises(ValueError, match="strategy='fused' cannot apply to DDP\\(Net\\)") as info:
                _step(compiled)
        msg = str(info.value)
        assert _unique_graphs() == before and not bucketwise.report(compiled).graphs
    assert "_custom_hook" in msg and "Pass strategy='auto', which runs 'split' here" in msg, msg
    auto = bucketwise.compile(ddp, backend="aot_eager", strategy="auto")  # auto falls back, saying why
    _step(auto)
    (graph,) = [g for g in bucketwise.report(auto).graphs if g.variant is None]
    assert graph.strategy == "split" and "_custom_hook" in graph.strategy_reason, graph


def test_explicit_fused_on_a_function_that_calls_ddp(single_rank_group):
    ddp = DDP(Net())
    fn = bucketwise.compile(lambda x: ddp(x).sum(), backend="aot_eager", strategy="fused")
    with pytest.raises(Exception) as info:  # raised while Dynamo compiles the DDP module's graph
        fn(torch.randn(2, 8))
    text = str(info.value)  # Dynamo's BackendCompilerFailed, naming the error
    assert "ValueError: strategy='fused' cannot apply to DDP(Net): fused needs bucketwise to run the DDP" in text
    assert "compile the DDP module itself" in text and "strategy='split'" in text, text
    split = bucketwise.compile(lambda x: ddp(x).sum(), backend="aot_eager", strategy="split")
    split(torch.randn(2, 8)).backward()  # split applies: DDP's reducer reduces


def test_unknown_fallback(ddp_model):
    _check_rejected(
        ddp_model, ValueError, "fallback", ["'ignore'", "eager", "raise"], backend="aot_eager", fallback="ignore"
    )


@pytest.mark.parametrize("name", ["bucket_cap_mb", "first_bucket_cap_mb"])
@pytest.mark.parametrize("value", [-1, -0.5, float("nan")], ids=["-1", "-0.5", "nan"])
def test_negative_bucket_cap(ddp_model, name, value):
    # 0 is accepted, as DDP accepts it (one parameter per bucket): see the feature matrix.
    _check_rejected(ddp_model, ValueError, name, ["0 or more"], backend="aot_eager", **{name: value})


@pytest.mark.parametrize("name", ["bucket_cap_mb", "first_bucket_cap_mb"])
@pytest.mark.parametrize("value", ["25", [25], True, 1j], ids=["str", "list", "bool", "complex"])
def test_non_numeric_bucket_cap(ddp_model, name, value):
    _check_rejected(ddp_model, TypeError, name, [], backend="aot_eager", **{name: value})


@pytest.mark.parametrize("name", ["bucket_cap_mb", "first_bucket_cap_mb"])
def test_infinite_bucket_cap(ddp_model, name):
    # A cap must be a finite number of MiB (DDP itself cannot take inf: int(inf) overflows).
    # Rejected up front, not at the first forward inside the Dynamo backend.
    _check_rejected(ddp_model, ValueError, name, [], backend="aot_eager", **{name: math.inf})


@pytest.mark.parametrize(
    "kwargs, exc_type, name",
    [
        ({"mode": 3}, TypeError, "mode"),
        ({"options": "max-autotune"}, TypeError, "options"),
        ({"mode": "max-autotune", "options": {}}, ValueError, "mode"),
        ({"mode": "reduce-overhead", "options": {"triton.cudagraphs": True}}, ValueError, "mode"),
        ({"dynamic": "yes"}, ValueError, "dynamic"),
        ({"fullgraph": "no"}, TypeError, "fullgraph"),
        ({"cudagraphs": "sometimes"}, ValueError, "cudagraphs"),
        ({"cudagraphs": 1}, ValueError, "cudagraphs"),
        ({"freeze": "yes"}, ValueError, "freeze"),
        ({"freeze": 1}, ValueError, "freeze"),
    ],
    ids=[
        "mode",
        "options",
        "mode+options",
        "reduce-overhead+options",
        "dynamic",
        "fullgraph",
        "cudagraphs",
        "cudagraphs=1",
        "freeze",
        "freeze=1",
    ],
)
def test_other_bad_options(ddp_model, kwargs, exc_type, name):
    _check_rejected(ddp_model, exc_type, name, [], backend="aot_eager", **kwargs)


def test_destroyed_process_group(single_rank_group):
    ddp = DDP(Net())
    dist.destroy_process_group()
    before = _unique_graphs()
    with pytest.raises(ValueError, match="process group|destroy_process_group|not initialized") as info:
        bucketwise.compile(ddp, backend="aot_eager")
    assert "obj" in str(info.value)
    _assert_nothing_compiled(before, ddp)


@pytest.mark.parametrize("strategy", ["fused", "split"])
def test_call_after_destroy_process_group(single_rank_group, strategy):
    eager = DDP(Net())
    compiled = bucketwise.compile(DDP(Net()), backend="aot_eager", strategy=strategy)
    for model in (eager, compiled):
        _step(model)
    dist.destroy_process_group()
    _step(eager)  # eager DDP over gloo keeps using the destroyed group's object
    if strategy == "split":
        _step(compiled)  # DDP's reducer reduces, as in eager DDP
        return
    # fused graphs find the group by its registered name: say that the group is gone
    with pytest.raises(RuntimeError, match=r"process group was destroyed \(destroy_process_group\(\) was called\)"):
        _step(compiled)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
@pytest.mark.parametrize("cudagraphs", [True, "auto"])
def test_cudagraphs_on_cpu_warns(ddp_model, caplog, cudagraphs):
    model = ddp_model
    ref = Net()
    ref.load_state_dict(model.module.state_dict())
    with caplog.at_level(logging.WARNING, logger="bucketwise"):
        compiled = bucketwise.compile(model, backend="aot_eager", cudagraphs=cudagraphs)
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if cudagraphs is True:
        assert any("cudagraphs=True is a no-op without CUDA" in m for m in messages), messages
    else:
        # "auto" means "where CUDA graphs apply": off without CUDA, nothing to warn about.
        assert not any("cudagraphs" in m for m in messages), messages
    # ... and it compiles and computes as eager.
    x = torch.randn(4, 8)
    torch.testing.assert_close(compiled(x), ref(x), rtol=1e-5, atol=1e-6)
    assert bucketwise.report(compiled).totals["graphs"] == 1


def test_report_of_non_compiled_object():
    with pytest.raises(TypeError, match="bucketwise.compile"):
        bucketwise.report(Net())


# --- DDP's own errors: raised by DDP(...) before bucketwise sees the model -------------------


def _check_ddp_rejected(make_ddp, exc_type, match: str) -> None:
    model = Net()
    before = _unique_graphs()
    with pytest.raises(exc_type, match=match):
        bucketwise.compile(make_ddp(model), backend="aot_eager")
    _assert_nothing_compiled(before, model)
    model(torch.randn(2, 8))  # untouched, still runs eagerly
    assert _unique_graphs() == before


def test_ddp_before_init_process_group():
    assert not dist.is_initialized()
    # torch 2.11 and 2.13: "Default process group has not been initialized, please make sure to
    # call init_process_group."
    _check_ddp_rejected(DDP, ValueError, r"process group has not been initialized.*init_process_group")


def test_ddp_device_ids_with_cpu_model(single_rank_group):
    # The model is on the CPU: DDP only takes device_ids for a module on one GPU.
    _check_ddp_rejected(
        lambda m: DDP(m, device_ids=[0]),
        ValueError,
        r"device_ids and output_device arguments only work with single-device/multiple-device GPU modules",
    )


# --- ranks that disagree (2 gloo processes) ---------------------------------------------------
# Workers return what they raised (type, message, graphs compiled) instead of raising, so the
# test can check every rank. Each case is bounded by a short timeout: none can hang CI.

_SHORT_S = 5


def _raised(exc: BaseException) -> BaseException:
    """The RankMismatchError inside Dynamo's BackendCompilerFailed, else ``exc`` itself."""
    from bucketwise.distributed.rank_check import RankMismatchError

    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, RankMismatchError):
        cause = cause.__cause__ or cause.__context__
    return cause or exc


def _failure(exc: BaseException, **extra) -> dict:
    """A worker's row for what it raised: the RankMismatchError inside, if any, and ``extra``."""
    exc = _raised(exc)
    return {"raised": type(exc).__name__, "message": str(exc), **extra}


def _step(compiled) -> None:
    compiled(torch.randn(2, 8)).sum().backward()


def _groups_of_different_sizes(rank: int, world: int, marker: str) -> dict:
    """Rank 0 wraps its model in DDP over both ranks, rank 1 over itself alone (e.g. a
    data-parallel group computed from a wrong world size)."""
    timeout = datetime.timedelta(seconds=_SHORT_S)
    pair = dist.new_group([0, 1], timeout=timeout)  # every rank creates every group
    alone = dist.new_group([1], timeout=timeout)
    before = _unique_graphs()
    if rank == 1:
        try:
            compiled = bucketwise.compile(DDP(Net(), process_group=alone), backend="aot_eager")
            _step(compiled)  # a 1-rank group: trains alone, nothing to notice
            graphs = len(bucketwise.report(compiled).graphs)
        finally:
            # Stay up until rank 0 has failed: a peer that exits changes rank 0's error.
            deadline = time.monotonic() + 30
            while not os.path.exists(marker) and time.monotonic() < deadline:
                time.sleep(0.05)
        return {"raised": None, "graphs": graphs}
    try:
        bucketwise.compile(DDP(Net(), process_group=pair), backend="aot_eager")
    except Exception as exc:  # noqa: BLE001 - checked by the test
        return {"raised": type(exc).__name__, "message": str(exc), "graphs": _unique_graphs() - before}
    finally:
        Path(marker).touch()
    return {"raised": None}


def test_ddp_process_groups_of_different_sizes(tmp_path):
    started = time.monotonic()
    r0, r1 = run_distributed(_groups_of_different_sizes, tmp_path, args=(str(tmp_path / "rank0_done"),), timeout=40)
    # DDP's own constructor checks parameter shapes with a collective over its group: rank 0
    # waits for rank 1 until the group's timeout. bucketwise is never reached there.
    assert r0["raised"] in ("RuntimeError", "DistBackendError"), r0
    assert "Timed out waiting" in r0["message"], r0["message"]
    assert r0["graphs"] == 0
    assert time.monotonic() - started < 35
    # Rank 1's group has one rank: it compiles and trains without any error.
    assert r1 == {"raised": None, "graphs": 1}


def _strategies_differ(rank: int, world: int) -> dict:
    from bucketwise.distributed.rank_check import TIMEOUT_ENV

    os.environ[TIMEOUT_ENV] = str(_SHORT_S)
    ddp = DDP(Net())
    before = _unique_graphs()
    try:
        compiled = bucketwise.compile(ddp, backend="aot_eager", strategy="fused" if rank == 0 else "split")
        _step(compiled)
    except Exception as exc:  # noqa: BLE001 - checked by the test
        return _failure(exc, graphs=_unique_graphs() - before)
    return {"raised": None}


def test_strategies_differ_between_ranks(tmp_path):
    started = time.monotonic()
    r0, r1 = run_distributed(_strategies_differ, tmp_path, timeout=30)
    # Rank 0 (fused) sets up bucketwise's rank checks in compile(); rank 1 (split) never joins:
    # a clear error after $BUCKETWISE_RANK_CHECK_TIMEOUT seconds, before anything is compiled.
    assert r0["raised"] == "RankMismatchError", r0
    for phrase in ("rank 0:", "did not set up bucketwise's rank checks", f"within {_SHORT_S} s", "same strategy"):
        assert phrase in r0["message"], r0["message"]
    assert r0["graphs"] == 0
    # Rank 1's DDP reducer allreduce fails once rank 0 has given up (gloo's own error).
    assert r1["raised"] is not None, r1
    assert time.monotonic() - started < 25


def _hook_on_one_rank(rank: int, world: int) -> dict:
    """Rank 0 puts a gradient hook on a parameter, rank 1 does not: under ``auto`` rank 0 would
    run ``split`` and rank 1 ``fused`` (NOTE [one decision across ranks])."""
    from bucketwise.distributed.rank_check import TIMEOUT_ENV

    os.environ[TIMEOUT_ENV] = str(_SHORT_S)
    ddp = DDP(Net())
    if rank == 0:
        next(ddp.module.parameters()).register_hook(lambda g: g.clamp(-1, 1))
    compiled = bucketwise.compile(ddp, backend="aot_eager")
    before = _unique_graphs()
    started = time.monotonic()
    try:
        _step(compiled)
    except Exception as exc:  # noqa: BLE001 - checked by the test
        return _failure(exc, graphs=_unique_graphs() - before, seconds=time.monotonic() - started)
    return {"raised": None}


def test_a_gradient_hook_on_one_rank_is_named_on_every_rank(tmp_path):
    for r in run_distributed(_hook_on_one_rank, tmp_path, timeout=60):
        assert r["raised"] == "RankMismatchError", r
        msg = r["message"]
        assert msg.startswith("the DDP module's gradient-reduction decision differs between ranks: "), msg
        assert (
            "rank 0 has 'gradient hooks on: l0.weight'" in msg and "rank 1 has 'gradient hooks on: no parameter'" in msg
        ), msg
        assert "register hooks on every rank" in msg, msg
        # At once, before anything compiled: not after the rank checks' timeout.
        assert r["graphs"] == 0 and r["seconds"] < _SHORT_S, r


def _bucket_caps_differ(rank: int, world: int) -> dict:
    ddp = DDP(Net(), bucket_cap_mb=0.0002 if rank == 0 else 25)  # 2 buckets on rank 0, 1 on rank 1
    compiled = bucketwise.compile(ddp, backend="aot_eager", strategy="fused")
    before = _unique_graphs()
    try:
        _step(compiled)
    except Exception as exc:  # noqa: BLE001 - checked by the test
        return _failure(exc, graphs=len(bucketwise.report(compiled).graphs), unique_graphs=_unique_graphs() - before)
    return {"raised": None}


def test_bucket_caps_differ_between_ranks(tmp_path):
    for r in run_distributed(_bucket_caps_differ, tmp_path, timeout=60):
        assert r["raised"] == "RankMismatchError", r
        msg = r["message"]
        assert msg.startswith("fused bucket layout differs between ranks: rank 0 has 'bucket 0: 2 params"), msg
        assert "rank 1 has 'bucket 0: 4 params" in msg, msg
        assert r["graphs"] == 0 and r["unique_graphs"] == 0, r


def _data_parallel_subgroups(rank: int, world: int) -> list[torch.Tensor]:
    """4 ranks, DDP over {0, 1} and {2, 3}: the DDP group's size (2) is not the world size."""
    import copy

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    pg = groups[rank // 2]
    torch.manual_seed(rank // 2)
    net = Net()
    ref = DDP(copy.deepcopy(net), process_group=pg)
    ddp = DDP(net, process_group=pg)
    compiled = bucketwise.compile(ddp, backend="aot_eager", strategy="fused")
    torch.manual_seed(100 + rank)
    for _ in range(2):
        x = torch.randn(3, 8)
        for m in (compiled, ref):
            m.zero_grad()
            m(x).sum().backward()
        for p, q in zip(ddp.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    assert [g["strategy"] for g in bucketwise.report(compiled).to_dict()["graphs"]] == ["fused"]
    return [p.grad for p in ddp.parameters()]


def test_ddp_over_subgroups_smaller_than_the_world(tmp_path):
    # Each pair sets up its own rank-check group (only its members take part): before, both
    # pairs created one under the same name and one pair raised a bogus RankMismatchError.
    grads = run_distributed(_data_parallel_subgroups, tmp_path, world_size=4, timeout=90)
    for a, b in ((0, 1), (2, 3)):
        for ga, gb in zip(grads[a], grads[b]):
            torch.testing.assert_close(ga, gb)  # averaged within the pair
    assert not all(torch.equal(ga, gb) for ga, gb in zip(grads[0], grads[2]))  # not across pairs
