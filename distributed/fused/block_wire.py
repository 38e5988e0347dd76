"""The bucket a shared block reduces itself under ``fused`` (NOTE [a bucket per block] in
``compiler/blocks.py``): the block's backward graph rewritten to return its parameters' gradients
last as one flat buffer in the wire's format (``grads_onto_wire``), the all-reduce of that
buffer into the gradients (``reduced_grads``), traced into the compiled backward around the block,
and those all-reduces grouped once the backward is traced (``grouping_pass``).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import sys
from typing import Any

import torch
import torch.fx as fx

from ..._compat import aot
from ..._compat import collectives as cc
from ...partitioners.block_graphs import NotShareable, TensorMeta, tensor_meta
from .. import plan
from .cache_keys import source_key
from .sync import CommSpec, unflatten


@dataclasses.dataclass(frozen=True)
class BlockWire:
    """``fused``: the inputs (DDP parameters) whose gradients the block reduces itself (NOTE
    [a bucket per block]): the backward returns them last, as one flat buffer in the wire's
    format, which the operation's autograd formula all-reduces and hands back as views."""

    reduced: tuple[int, ...]
    spec: CommSpec
    """How the gradients go over the wire (the DDP module's reducer or compress hook)."""
    reduced_shapes: tuple[torch.Size, ...]
    grad_dtype: torch.dtype
    """The dtype of the gradients (the wire's may differ: a compress hook)."""


def grads_onto_wire(
    bw: fx.GraphModule,
    params: list[torch.Tensor],
    reduced: tuple[int, ...],
    spec: CommSpec,
    fake_mode: Any,
    *,
    decompose: bool,
) -> tuple[BlockWire, tuple[TensorMeta | None, ...]]:
    """Rewrite ``bw`` in place so that it returns the gradients of the ``reduced`` inputs (the
    block's parameters, fakes ``params``) last, as one flat buffer in the wire's format (each
    flattened, cast and scaled as ``CommSpec.to_wire`` says, in input order, zeros for a
    parameter the block leaves without a gradient) (NOTE [a bucket per block]), decomposed as
    ``bw`` was (``decompose``). Returns the reduction and what ``bw`` returns now."""
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1 and spec.comm_dtype is None:
        raise NotShareable(f"the block's parameters have several dtypes ({sorted(map(str, dtypes))})")
    graph = bw.graph
    out_node = next(iter(graph.find_nodes(op="output")))
    outs = list(out_node.args[0])
    grads = [outs[i] for i in reduced]
    present = [g for g in grads if isinstance(g, fx.Node)]

    def pack(*given: torch.Tensor) -> torch.Tensor:
        # Zeros for a parameter without a gradient, as ``BucketSync`` fills them.
        it = iter(given)
        full = [
            next(it) if isinstance(g, fx.Node) else torch.zeros(p.shape, dtype=p.dtype, device=p.device)
            for g, p in zip(grads, params)
        ]
        # The graph is traced while the forward compiles, under the forward's autocast if any.
        with torch.autocast(params[0].device.type, enabled=False):
            return torch.cat([spec.to_wire(g.reshape(-1)) for g in full])

    with graph.inserting_before(out_node):
        buffer = aot.trace_into(graph, pack, present, fake_mode, decompose=decompose)
    positions = set(reduced)
    new_outs = [o for i, o in enumerate(outs) if i not in positions] + [buffer]
    out_node.args = (tuple(new_outs),)
    graph.eliminate_dead_code()
    graph.lint()
    bw.recompile()
    wire = BlockWire(
        reduced=reduced,
        spec=spec,
        reduced_shapes=tuple(torch.Size(p.shape) for p in params),
        grad_dtype=params[0].dtype,
    )
    return wire, tuple(tensor_meta(n) if isinstance(n, fx.Node) else None for n in new_outs)


def reduced_grads(wire: BlockWire, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """The gradient of every input, those of ``wire.reduced`` all-reduced from the flat buffer
    the shared backward returned last (NOTE [a bucket per block])."""
    *others, flat = grads
    if flat is None:
        raise AssertionError("expected the shared backward's flat gradient buffer last, got None")
    spec = wire.spec
    reduced = spec.all_reduce(flat)
    if spec.comm_dtype is not None:
        reduced = reduced.to(wire.grad_dtype)
    params, rest = iter(unflatten(reduced, wire.reduced_shapes)), iter(others)
    positions = set(wire.reduced)
    return [next(params) if i in positions else next(rest) for i in range(len(others) + len(positions))]


# NOTE [block reductions grouped]: a bucket per block (NOTE [a bucket per block]) is a collective
# per block, and each collective costs the host time whatever its size (NOTE [fused bucket
# sizes]). So once the backward around the blocks is traced, a post-grad pass groups the blocks'
# all-reduces in the order the backward issues them, by the fused rule's sizes over the blocks'
# bytes (``plan.overlap_limits``: a quarter each, then halving, none below the DDP module's cap),
# and each group becomes one ``all_reduce_coalesced`` issued when its last block's backward is
# done (NCCL runs the group as one launch), which the late-waits pass schedules as any collective
# (NOTE [late waits]). The gradients, their values and the report's buckets (one per block) are
# unchanged; blocks whose bytes reach the cap alone stay a collective each (the exposed tail). An
# Inductor ``post_grad_custom_post_pass`` of the user's own replaces this pass.


def group_block_reductions(graph: fx.Graph, *, producer: str, floor_bytes: int) -> None:
    """Group the all-reduces of the flat buffers that ``producer`` (the shared block's backward
    operator, ``namespace::name``) returns (NOTE [block reductions grouped])."""
    nodes = [n for n in graph.nodes if cc.is_all_reduce(n) and _reduces_block(n, producer)]
    if len(nodes) < 2:
        return
    sizes = [n.args[0].meta["val"].numel() * n.args[0].meta["val"].element_size() for n in nodes]
    limits = plan.overlap_limits(sum(sizes), floor_bytes)
    groups: list[list[fx.Node]] = [[]]
    used = 0
    for node, size in zip(nodes, sizes):
        if groups[-1] and _dtype(groups[-1][-1]) != _dtype(node):  # one dtype per coalesced call
            groups.append([])
            used = 0
        groups[-1].append(node)
        used += size
        # As DDP's reducer closes a bucket: once its bytes reach the cap (the last one repeats).
        if used >= limits[min(len(groups) - 1, len(limits) - 1)]:
            groups.append([])
            used = 0
    cc.coalesce_all_reduces(graph, [g for g in groups if len(g) > 1])


def _dtype(node: fx.Node) -> torch.dtype:
    return node.args[0].meta["val"].dtype


def _reduces_block(node: fx.Node, producer: str) -> bool:
    flat = node.args[0]
    return (
        isinstance(flat, fx.Node)
        and flat.op == "call_function"
        and flat.target is operator.getitem
        and cc.op_name(flat.args[0]) == producer
    )


def grouping_pass(producer: str, floor_bytes: int) -> Any:
    """:func:`group_block_reductions` as Inductor's post-grad pass, cache-keyed by this code
    (NOTE [compile cache keys]), the operator and the cap."""
    key = f"{source_key(plan, cc, sys.modules[__name__])}-{producer}-{floor_bytes}"
    return cc.post_grad_pass(functools.partial(group_block_reductions, producer=producer, floor_bytes=floor_bytes), key)
