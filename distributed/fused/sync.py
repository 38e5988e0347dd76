"""The fused strategy: gradient allreduces traced into the compiled backward.

NOTE [fused strategy]: split couples bucket size to graph breaks; here every Dynamo graph stays
whole. Each bucket gets one ``BucketSync`` before its earliest parameter use; its forward hands
out views of the parameters, and its backward (run once all the bucket's gradients exist)
all-reduces them. AOTAutograd traces that backward into the compiled graph, so Inductor
schedules the collective (``comm_overlap_options``). DDP's reducer is kept idle
(``fused_runtime``): nothing is reduced twice.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import operator
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx

from ..._compat import collectives as cc
from ...partitioners.param_usage import GraphParam
from ...partitioners.regions import outside_regions, transform_regions
from ...partitioners.split import LazyGraph

log = logging.getLogger(__name__)

BUCKET_META_KEY = "bucketwise.bucket"
REDUCED_PARAMS_META = "bucketwise.reduced_params"
"""``node.meta`` key of a call that reduces a bucket itself (a shared block, NOTE [a bucket per
block] in ``compiler/blocks/__init__.py``): the placeholders of the bucket's parameters."""


# NOTE [the average in the collective]: the reducer computes ``sum(grad * (1/world))``; NCCL's
# ``avg`` on floats is the same rule inside its kernel, so the bits match and the graph saves a
# multiply kernel per gradient Inductor cannot fuse. Used only for the reducer's rule on NCCL and
# where bits agree: fp32/fp64, or fp16/bf16 with a power-of-2 world size. On one rank nothing is
# scaled and the bucket is summed (NCCL's one-rank sum is no kernel; its average copies).


@dataclasses.dataclass(frozen=True)
class CommSpec:
    """How one bucket is reduced, mirroring DDP's reducer or its registered comm hook."""

    group: str
    """Functional-collectives process group name."""
    world_size: int
    comm_dtype: torch.dtype | None = None
    """Compress to this dtype for the wire (``bf16_compress_hook``/``fp16_compress_hook``)."""
    divide_first: bool = False
    """``True``: divide by the world size (as the Python hooks do); ``False``: multiply by its
    reciprocal (as the C++ reducer does), so results match eager DDP bit for bit where they can."""
    average_in_collective: bool = False
    """``True``: the group's all-reduce can average as the reducer scales (NCCL's ``avg``), and
    does for the buckets ``averages`` says, whose gradients ``to_wire`` leaves unscaled (NOTE [the
    average in the collective]); only with ``divide_first=False`` and no ``comm_dtype``."""

    def __post_init__(self) -> None:
        if self.average_in_collective and (self.divide_first or self.comm_dtype is not None):
            raise ValueError(
                "CommSpec(average_in_collective=True) is the reducer's rule (multiply, then sum, in "
                f"the gradients' dtype); got divide_first={self.divide_first}, comm_dtype={self.comm_dtype}"
            )

    def describe(self) -> str:
        return str(self.comm_dtype).removeprefix("torch.") if self.comm_dtype else "same as grads"

    def averages(self, dtype: torch.dtype) -> bool:
        """See NOTE [the average in the collective]."""
        if not self.average_in_collective or self.world_size == 1:
            return False
        return dtype in (torch.float32, torch.float64) or self.world_size & (self.world_size - 1) == 0

    def reduce_op(self, dtype: torch.dtype) -> str:
        return "avg" if self.averages(dtype) else "sum"

    def scaled(self, grad: torch.Tensor) -> torch.Tensor:
        """A gradient scaled as DDP scales it before the sum: ``grad * (1/world)`` (reducer) or
        ``grad.to(dtype) / world`` (compress hooks). Bit parity with eager DDP rests on this."""
        wire = grad.to(self.comm_dtype) if self.comm_dtype is not None else grad
        if self.world_size == 1:
            return wire  # the scale by 1 is the identity (NOTE [the average in the collective])
        return wire / self.world_size if self.divide_first else wire * (1.0 / self.world_size)

    def to_wire(self, grad: torch.Tensor) -> torch.Tensor:
        """A gradient as it goes into ``all_reduce``."""
        return grad if self.averages(grad.dtype) else self.scaled(grad)

    def all_reduce(self, wire: torch.Tensor) -> torch.Tensor:
        return cc.all_reduce(wire, self.group, self.reduce_op(wire.dtype))

    def as_args(self) -> tuple[Any, ...]:
        """As graph arguments: FX writes a dataclass as its repr, which a fallback cannot evaluate."""
        return (self.group, self.world_size, self.comm_dtype, self.divide_first, self.average_in_collective)


def reducer_spec(pg: Any) -> CommSpec:
    """DDP's reducer rule on ``pg`` (NOTE [the average in the collective])."""
    pg = pg if pg is not None else dist.group.WORLD
    return CommSpec(
        group=cc.group_name(pg), world_size=cc.world_size(pg), average_in_collective=cc.averages_natively(pg)
    )


def group_spec(pg: Any) -> CommSpec:
    """torch's ``allreduce_hook`` on ``pg``: divide, then sum."""
    pg = pg if pg is not None else dist.group.WORLD
    return CommSpec(group=cc.group_name(pg), world_size=cc.world_size(pg), divide_first=True)


class BucketSync(torch.autograd.Function):
    """Identity in the forward; all-reduces the bucket's gradients in the backward."""

    @staticmethod
    def forward(ctx: Any, spec: CommSpec, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.spec = spec
        ctx.shapes = [(p.shape, p.dtype, p.device) for p in params]
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        spec: CommSpec = ctx.spec
        full = filled_grads(grads, ctx.shapes)
        # Scale each gradient before the cat, so Inductor writes them straight into one flat buffer.
        # Autocast (the forward's, traced into the backward) rejects a cat of fp16 under bf16 on CPU.
        with torch.autocast(full[0].device.type, enabled=False):
            wire = torch.cat([spec.to_wire(g.reshape(-1)) for g in full])
        reduced = spec.all_reduce(wire)
        if spec.comm_dtype is not None:
            reduced = reduced.to(full[0].dtype)
        return (None, *split_like(reduced, full))


def filled_grads(grads: Sequence[torch.Tensor | None], shapes: Sequence[tuple[Any, Any, Any]]) -> list[torch.Tensor]:
    """A bucket's gradients, zeros where autograd passed none."""
    return [
        g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
        for g, (shape, dtype, device) in zip(grads, shapes)
    ]


def split_like(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return unflatten(flat, [g.shape for g in like])


def unflatten(flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    """Views of a flat buffer, one ``as_strided`` each (a slice plus a view is two graph nodes)."""
    total = sum(shape.numel() for shape in shapes)
    if flat.dim() != 1 or not flat.is_contiguous() or total > flat.numel():
        # ``as_strided`` would silently read past the end or across gaps.
        raise AssertionError(
            f"expected a contiguous flat buffer of at least {total} elements, "
            f"got shape {tuple(flat.shape)} and strides {flat.stride()}"
        )
    out: list[torch.Tensor] = []
    offset = flat.storage_offset()
    for shape in shapes:
        out.append(flat.as_strided(shape, _contiguous_strides(shape), offset))
        offset += shape.numel()
    return out


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def bucket_sync(
    group: str,
    world_size: int,
    comm_dtype: torch.dtype | None,
    divide_first: bool,
    average_in_collective: bool,
    *params: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """The graph's call target (see ``as_args``): FX cannot write ``BucketSync.apply`` callably."""
    return BucketSync.apply(CommSpec(group, world_size, comm_dtype, divide_first, average_in_collective), *params)


def insert_bucket_syncs(
    gm: fx.GraphModule,
    buckets: Sequence[Sequence[GraphParam]],
    spec: CommSpec,
    *,
    target: Callable[..., Any] = bucket_sync,
    bucket_args: Callable[[int], tuple[Any, ...]] | None = None,
) -> fx.GraphModule:
    """In place: per bucket, ``target(*bucket_args(index), *params)`` before its earliest use."""
    log.debug("graph before bucket syncs:\n%s", LazyGraph(gm))
    nodes = list(gm.graph.nodes)
    regions = transform_regions(gm)
    for index, bucket in enumerate(buckets):
        params = [p for p in bucket if p.first_use >= 0]
        if not params:
            continue
        # Before any torch.func transform the first use sits in (see partitioners/regions.py).
        first_user = nodes[outside_regions(min(p.first_use for p in params), regions)]
        leading = spec.as_args() if bucket_args is None else bucket_args(index)
        with gm.graph.inserting_before(first_user):
            sync = gm.graph.call_function(target, (*leading, *[p.node for p in params]))
            sync.meta[BUCKET_META_KEY] = index
            views = []
            for i, p in enumerate(params):
                view = gm.graph.call_function(operator.getitem, (sync, i))
                view.meta.update(p.node.meta)
                view.meta[BUCKET_META_KEY] = index
                views.append(view)
            if all("example_value" in p.node.meta for p in params):
                sync.meta["example_value"] = tuple(p.node.meta["example_value"] for p in params)
        for p, view in zip(params, views):
            p.node.replace_all_uses_with(view, delete_user_cb=lambda user: user is not sync)  # noqa: B023 - called here
    gm.graph.lint()
    gm.recompile()
    log.debug("graph after bucket syncs:\n%s", LazyGraph(gm))
    return gm


def backward_positions(gm: fx.GraphModule, buckets: Sequence[Sequence[GraphParam]]) -> list[float]:
    """Where each bucket's allreduce is issued, as a fraction of the backward (run in reverse)."""
    n = max(1, sum(1 for node in gm.graph.nodes if node.op not in ("placeholder", "output")))
    offset = sum(1 for node in gm.graph.nodes if node.op == "placeholder")
    out = []
    for bucket in buckets:
        used = [p.first_use for p in bucket if p.first_use >= 0]
        first = (min(used) - offset) if used else 0
        out.append(round(min(1.0, max(0.0, (n - first) / n)), 4))
    return out


def fresh_copy(
    gm: fx.GraphModule, buckets: Sequence[Sequence[GraphParam]], inputs: Sequence[Any], name: str
) -> tuple[fx.GraphModule, list[list[GraphParam]], list[fx.Node]]:
    """A copy of ``gm`` without Dynamo metadata, with placeholders for ``inputs``, buckets remapped."""
    graph = copy.deepcopy(gm.graph)
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    nodes = list(graph.nodes)
    last = list(graph.find_nodes(op="placeholder"))[-1]
    extra = []
    for i, value in enumerate(inputs):
        with graph.inserting_after(last):
            last = graph.placeholder(f"{name}_{i}")
        last.meta["example_value"] = value
        extra.append(last)
    # Every parameter's first use follows the placeholders: it moves by as many nodes as added.
    moved = [
        [
            dataclasses.replace(
                p, node=nodes[position[p.node]], first_use=p.first_use + len(extra) if p.first_use >= 0 else -1
            )
            for p in b
        ]
        for b in buckets
    ]
    graph.lint()
    return fx.GraphModule(gm, graph), moved, extra
