"""``CommSpec``: where a bucket's ``1/world`` scale happens (NOTE [the average in the collective]
in ``distributed/fused/sync.py``): in the graph before a sum, or inside an averaging all-reduce."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from bucketwise._compat import ddp_hooks
from bucketwise.distributed.fused.hook_kinds import hook_kind
from bucketwise.distributed.fused.sync import CommSpec, bucket_sync, reducer_spec


class _Ops(TorchDispatchMode):
    """Records each op's name, and each functional all-reduce's op argument."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self.reduce_ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        if func.name().startswith("_c10d_functional::all_reduce"):
            self.reduce_ops.append(args[1])
        return func(*args, **(kwargs or {}))


def _backward_ops(spec: CommSpec) -> _Ops:
    """The ops of one bucket's backward (two parameters), on fake tensors: nothing is sent."""
    with FakeTensorMode():
        params = [torch.randn(3, 4, requires_grad=True), torch.randn(5, requires_grad=True)]
        views = bucket_sync(*spec.as_args(), *params)
        loss = sum(v.sum() for v in views)
        with _Ops() as ops:
            loss.backward()
    return ops


def test_the_reducer_rule_scales_in_the_graph_then_sums(single_rank_group):
    spec = CommSpec(group=reducer_spec(single_rank_group).group, world_size=4)
    ops = _backward_ops(spec)
    assert ops.reduce_ops == ["sum"]
    assert ops.names.count("aten::mul.Tensor") == 2, ops.names  # one per gradient, onto the wire


def test_an_averaging_collective_leaves_the_gradients_unscaled(single_rank_group):
    spec = CommSpec(group=reducer_spec(single_rank_group).group, world_size=4, average_in_collective=True)
    ops = _backward_ops(spec)
    assert ops.reduce_ops == ["avg"]
    assert not [n for n in ops.names if n.startswith(("aten::mul", "aten::div"))], ops.names
    grad = torch.full((3,), 3.0)
    assert torch.equal(spec.to_wire(grad), grad)
    assert torch.equal(spec.scaled(grad), grad * 0.25)  # what a gather (embedding rows) still sends


@pytest.mark.parametrize("average_in_collective", [True, False])
def test_one_rank_sums_unscaled(single_rank_group, average_in_collective):
    """On one rank the scale is by 1: no multiply in the graph and a sum, not NCCL's average
    (a pre-multiplied copy of the bucket where the in-place sum of one rank is no work)."""
    group = reducer_spec(single_rank_group).group
    spec = CommSpec(group=group, world_size=1, average_in_collective=average_in_collective)
    ops = _backward_ops(spec)
    assert ops.reduce_ops == ["sum"]
    assert not [n for n in ops.names if n.startswith(("aten::mul", "aten::div"))], ops.names
    grad = torch.tensor([3.0, -0.0, float("inf"), 1e-45])
    assert torch.equal(spec.to_wire(grad), grad) and spec.to_wire(grad).sign().equal(grad.sign())
    assert torch.equal(spec.scaled(grad), grad * (1.0 / 1))
    bf16 = CommSpec(group="0", world_size=1, comm_dtype=torch.bfloat16)
    assert bf16.scaled(grad).dtype == torch.bfloat16  # a compress hook's cast stays


@pytest.mark.parametrize(
    ("dtype", "world", "averages"),
    [
        (torch.float32, 3, True),
        (torch.float64, 6, True),
        (torch.bfloat16, 4, True),
        (torch.float16, 2, True),
        (torch.bfloat16, 3, False),
        (torch.float16, 6, False),
    ],
)
def test_16_bit_gradients_average_in_the_collective_only_where_the_bits_agree(dtype, world, averages):
    """NCCL scales 16-bit data by ``1/world`` rounded to 16 bits, the reducer by the fp32 value:
    the same bits only where ``1/world`` is exact (a power of 2)."""
    spec = CommSpec(group="0", world_size=world, average_in_collective=True)
    assert spec.averages(dtype) is averages
    assert spec.reduce_op(dtype) == ("avg" if averages else "sum")
    grad = torch.full((3,), 3.0, dtype=dtype)
    assert torch.equal(spec.to_wire(grad), grad if averages else grad * (1.0 / world))


def test_gloo_keeps_the_scale_in_the_graph(single_rank_group):
    """gloo has no average: the reducer's rule stays a multiply and a sum."""
    spec = reducer_spec(single_rank_group)
    assert not spec.average_in_collective and spec.reduce_op(torch.float32) == "sum"


def test_hooks_divide_and_never_average_in_the_collective(single_rank_group, monkeypatch):
    """torch's comm hooks divide (``x / world``), which an average by ``float(1/world)`` would not
    match bit for bit: their specs keep the division in the graph."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh

    for hook, dtype in (
        (dh.allreduce_hook, None),
        (dh.bf16_compress_hook, torch.bfloat16),
        (dh.fp16_compress_hook, torch.float16),
    ):
        # The hook as DDP keeps it (registering bf16's needs CUDA).
        monkeypatch.setattr(ddp_hooks, "comm_hook", lambda ddp, hook=hook: (hook, None))
        kind = hook_kind(object())
        spec = kind.spec(single_rank_group)
        assert kind.plain and (spec.divide_first, spec.comm_dtype, spec.average_in_collective) == (
            True,
            dtype,
            False,
        ), kind


@pytest.mark.parametrize("fields", [{"divide_first": True}, {"comm_dtype": torch.bfloat16}])
def test_average_in_collective_is_only_the_reducer_rule(fields):
    with pytest.raises(ValueError, match="average_in_collective=True"):
        CommSpec(group="0", world_size=2, average_in_collective=True, **fields)
