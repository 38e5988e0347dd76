"""bucketwise.compile rejects bad arguments up front, with the argument named, and compiles
nothing; soft options that cannot apply (cudagraphs on CPU) only warn."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import bucketwise


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l0 = nn.Linear(8, 16)
        self.l1 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l1(torch.tanh(self.l0(x)))


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


@pytest.mark.parametrize("use_ddp", [True, False], ids=["ddp", "module"])
def test_unknown_backend(request, use_ddp):
    target = request.getfixturevalue("ddp_model") if use_ddp else Net()
    _check_rejected(target, ValueError, "backend", ["'no_such_backend'", "inductor", "aot_eager", "eager"], backend="no_such_backend")


def test_non_callable_backend():
    _check_rejected(Net(), TypeError, "backend", [], backend=3)


@pytest.mark.parametrize("use_ddp", [True, False], ids=["ddp", "module"])
def test_unknown_strategy(request, use_ddp):
    target = request.getfixturevalue("ddp_model") if use_ddp else Net()
    _check_rejected(target, ValueError, "strategy", ["'bucketed'", "split", "none", "auto"], backend="aot_eager", strategy="bucketed")


def test_unknown_fallback(ddp_model):
    _check_rejected(ddp_model, ValueError, "fallback", ["'ignore'", "eager", "raise"], backend="aot_eager", fallback="ignore")


@pytest.mark.parametrize("name", ["bucket_cap_mb", "first_bucket_cap_mb"])
@pytest.mark.parametrize("value", [0, -1, -0.5, 0.0, float("nan")], ids=["0", "-1", "-0.5", "0.0", "nan"])
def test_non_positive_bucket_cap(ddp_model, name, value):
    _check_rejected(ddp_model, ValueError, name, [], backend="aot_eager", **{name: value})


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
        ({"dynamic": "yes"}, ValueError, "dynamic"),
        ({"fullgraph": "no"}, TypeError, "fullgraph"),
        ({"cudagraphs": "sometimes"}, ValueError, "cudagraphs"),
    ],
    ids=["mode", "options", "mode+options", "dynamic", "fullgraph", "cudagraphs"],
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


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
@pytest.mark.parametrize("cudagraphs", [True, "auto"])
def test_cudagraphs_on_cpu_warns(ddp_model, caplog, cudagraphs):
    model = ddp_model
    ref = Net()
    ref.load_state_dict(model.module.state_dict())
    with caplog.at_level(logging.WARNING, logger="bucketwise"):
        compiled = bucketwise.compile(model, backend="aot_eager", cudagraphs=cudagraphs)
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("cudagraphs" in m for m in messages), messages
    # ... and it compiles and computes as eager.
    x = torch.randn(4, 8)
    torch.testing.assert_close(compiled(x), ref(x), rtol=1e-5, atol=1e-6)
    assert bucketwise.report(compiled).totals["graphs"] == 1


def test_report_of_non_compiled_object():
    with pytest.raises(TypeError, match="bucketwise.compile"):
        bucketwise.report(Net())
