"""Embedding gradients reduced as the rows each rank looked up (fused strategy).

NOTE [embedding rows]: a table's gradient is complete only at the end of the backward, so its
all-reduce overlaps nothing, and it is zero outside the looked-up rows. Being linear,
avg_r E(g_r, ids_r) == E(cat_r(g_r / world), cat_r(ids_r)), so ``fused`` all-gathers rows and ids
where ``world x ids <= rows`` and every rank builds the average. Ranks must get the same bits, so
``bucketwise::embedding_rows_grad`` (opaque to Inductor) runs ATen's deterministic kernel, not an
atomic scatter-add. Only tables used solely by plain ``F.embedding`` with static id counts qualify,
and all ranks must look up as many ids (NOTE [fused layout check]).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..._compat import collectives as cc
from ...partitioners.param_usage import GraphParam
from ...partitioners.regions import transform_regions
from ...partitioners.split import LazyGraph
from .sync import CommSpec

log = logging.getLogger(__name__)

ROWS_META_KEY = "bucketwise.embedding_rows"

_EMBEDDING_SIGNATURE = inspect.signature(F.embedding)


@torch.library.custom_op("bucketwise::embedding_rows_grad", mutates_args=())
def embedding_rows_grad(rows: torch.Tensor, ids: torch.Tensor, num_weights: int, padding_idx: int) -> torch.Tensor:
    """See NOTE [embedding rows]."""
    return torch.ops.aten.embedding_dense_backward(rows, ids, num_weights, padding_idx, False)


@embedding_rows_grad.register_fake
def _(rows: torch.Tensor, ids: torch.Tensor, num_weights: int, padding_idx: int) -> torch.Tensor:
    return rows.new_empty((num_weights, rows.shape[-1]))


@dataclasses.dataclass(frozen=True)
class Lookup:
    """One ``F.embedding`` call that reads a table."""

    node: fx.Node
    ids_node: fx.Node
    ids: int
    """Ids looked up per rank (a static count)."""
    padding_idx: int | None


@dataclasses.dataclass(frozen=True)
class RowsSync:
    """A table whose gradient is reduced as gathered rows, and the lookups that read it."""

    param: GraphParam
    lookups: tuple[Lookup, ...]

    @property
    def ids(self) -> int:
        return sum(lk.ids for lk in self.lookups)

    @property
    def shape(self) -> tuple[int, int]:
        rows, dim = self.param.tensor.shape
        return int(rows), int(dim)

    def wire_bytes(self, comm_dtype: torch.dtype | None) -> int:
        """Bytes this rank sends: rows plus ids as digits (NOTE [ids in the rows])."""
        rows, dim = self.shape
        return self.ids * (dim + _digit_count(rows)) * (comm_dtype or self.param.dtype).itemsize

    def signature(self, spec: Any) -> str:
        rows, dim = self.shape
        return (
            f"embedding rows of {self.param.name} ({rows} x {dim}, {self.param.dtype}, "
            f"{spec.describe()}): {len(self.lookups)} lookup(s), {self.ids} ids per rank"
        )


def _embedding_args(node: fx.Node) -> dict[str, Any] | None:
    """The arguments of an ``F.embedding`` call node by name (defaults filled in), else ``None``."""
    if node.op != "call_function" or node.target is not F.embedding:
        return None
    try:
        bound = _EMBEDDING_SIGNATURE.bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return dict(bound.arguments)


def _lookup(node: fx.Node, weight: fx.Node, rows: int) -> Lookup | str:
    """The lookup ``node`` makes of ``weight``, or why it does not qualify."""
    a = _embedding_args(node)
    if a is None:
        return f"used by {node.format_node()[:80]}"
    if a["weight"] is not weight or a["input"] is weight:
        return "not the lookup table of F.embedding"
    if a["max_norm"] is not None or a["scale_grad_by_freq"] or a["sparse"]:
        return "max_norm, scale_grad_by_freq or sparse"
    ids = a["input"].meta.get("example_value") if isinstance(a["input"], fx.Node) else None
    if not isinstance(ids, torch.Tensor) or not all(isinstance(s, int) for s in ids.shape):
        return "ids without a static shape"
    padding_idx = a["padding_idx"]
    if padding_idx is not None and padding_idx < 0:
        padding_idx += rows
    return Lookup(node=node, ids_node=a["input"], ids=math.prod(ids.shape), padding_idx=padding_idx)


def plan_embedding_rows(gm: fx.GraphModule, params: Sequence[GraphParam], world: int) -> list[RowsSync]:
    """The parameters of ``gm`` whose gradient is cheaper to reduce as gathered rows."""
    regions = transform_regions(gm)
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    out = []
    for p in params:
        if p.first_use < 0 or p.in_higher_order_op or p.tensor.dim() != 2:
            continue
        rows = p.tensor.shape[0]
        lookups = [_lookup(user, p.node, rows) for user in sorted(p.node.users, key=position.__getitem__)]
        why = next((lk for lk in lookups if isinstance(lk, str)), None)
        if why is None:
            sync = RowsSync(param=p, lookups=tuple(lookups))
            if any(s <= position[lk.node] <= e for lk in lookups for s, e in regions):
                why = "inside a torch.func transform"
            elif world == 1:
                why = "one rank: nothing is sent either way, and the table's own backward is cheaper"
            elif world * sync.ids > rows:
                why = f"{world} ranks x {sync.ids} ids > {rows} rows: the allreduce sends less"
            else:
                out.append(sync)
                continue
        if any(_embedding_args(u) is not None for u in p.node.users):
            log.debug("bucketwise fused: %s keeps its table allreduce: %s", p.name, why)
    return out


class EmbeddingRows(torch.autograd.Function):
    """``F.embedding`` in the forward; gathers the rows and ids of every rank in the backward."""

    @staticmethod
    def forward(ctx: Any, spec: Any, padding_idx: int | None, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.spec, ctx.padding_idx, ctx.rows = spec, padding_idx, weight.shape[0]
        ctx.save_for_backward(ids)
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        spec = ctx.spec
        (ids,) = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        dim = g.shape[-1]
        # Gathered, not reduced: each rank's rows scaled here, whatever the all-reduces do.
        wire = spec.scaled(g)
        # NOTE [ids in the rows]: one collective carries rows and ids so it depends on the
        # gradient and stays in the backward; an ids-only gather would be moved to the forward,
        # where a captured NCCL kernel keeps ncclCommDestroy from returning.
        digits = _ids_to_digits(ids.reshape(-1), ctx.rows, wire.dtype)
        # Autocast (the forward's, traced into the backward) rejects cat of fp16 under bf16 on CPU.
        with torch.autocast(g.device.type, enabled=False):
            packed = cc.all_gather(torch.cat([wire, digits], 1), spec.group, spec.world_size)
        rows, all_ids = packed[:, :dim].to(g.dtype), _digits_to_ids(packed[:, dim:])
        padding = -1 if ctx.padding_idx is None else ctx.padding_idx
        return None, None, None, torch.ops.bucketwise.embedding_rows_grad(rows, all_ids, ctx.rows, padding)


_DIGIT = 256
"""Ids travel as base-256 digits: integers up to 256 are exact in every float dtype (bf16 too)."""


def _digit_count(rows: int) -> int:
    """Base-256 digits that hold every id of a ``rows``-row table."""
    return max(1, math.ceil(math.log(max(rows, 2), _DIGIT)))


def _ids_to_digits(ids: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """``ids`` as ``[n, k]`` base-256 digits in ``dtype``, least significant first."""
    return torch.stack([(ids // _DIGIT**i) % _DIGIT for i in range(_digit_count(rows))], 1).to(dtype)


def _digits_to_ids(digits: torch.Tensor) -> torch.Tensor:
    d = digits.float().round().long()
    return sum(d[:, i] * _DIGIT**i for i in range(d.shape[1]))


def embedding_rows(
    group: str,
    world_size: int,
    comm_dtype: torch.dtype | None,
    divide_first: bool,
    average_in_collective: bool,
    padding_idx: int | None,
    ids: torch.Tensor,
    weight: torch.Tensor,
) -> torch.Tensor:
    """The graph's call target (see ``fused.bucket_sync``)."""
    spec = CommSpec(group, world_size, comm_dtype, divide_first, average_in_collective)
    return EmbeddingRows.apply(spec, padding_idx, ids, weight)


def renormed_tables(gm: fx.GraphModule, params: Sequence[GraphParam]) -> list[GraphParam]:
    """Tables ``max_norm`` renormalises in place; reduced after the backward instead (NOTE
    [fused strategy runtime])."""

    def renormed(user: fx.Node, weight: fx.Node) -> bool:
        a = _embedding_args(user)
        return a is not None and a["weight"] is weight and a["max_norm"] is not None

    return [p for p in params if any(renormed(user, p.node) for user in p.node.users)]


def insert_embedding_rows(gm: fx.GraphModule, syncs: Sequence[RowsSync], spec: Any) -> fx.GraphModule:
    """Graph pass, in place: each lookup of a table in ``syncs`` becomes an ``EmbeddingRows``."""
    if not syncs:
        return gm
    log.debug("graph before embedding rows:\n%s", LazyGraph(gm))
    for index, sync in enumerate(syncs):
        for lk in sync.lookups:
            with gm.graph.inserting_before(lk.node):
                new = gm.graph.call_function(
                    embedding_rows, (*spec.as_args(), lk.padding_idx, lk.ids_node, sync.param.node)
                )
            new.meta.update(lk.node.meta)
            new.meta[ROWS_META_KEY] = index
            lk.node.replace_all_uses_with(new)
            gm.graph.erase_node(lk.node)
    gm.graph.lint()
    gm.recompile()
    log.debug("graph after embedding rows:\n%s", LazyGraph(gm))
    return gm
