"""The bucket a shared block reduces itself under ``fused`` (NOTE [a bucket per block] in
``compiler/blocks.py``): the block's backward graph rewritten to return its parameters' gradients
last as one flat buffer in the wire's format (``grads_onto_wire``), and the all-reduce of that
buffer into the gradients (``reduced_grads``), traced into the compiled backward around the block.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx

from ..._compat import aot
from ...partitioners.block_graphs import NotShareable, TensorMeta, tensor_meta
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
) -> tuple[BlockWire, tuple[TensorMeta | None, ...]]:
    """Rewrite ``bw`` in place so that it returns the gradients of the ``reduced`` inputs (the
    block's parameters, fakes ``params``) last, as one flat buffer in the wire's format (each
    flattened, cast and scaled as ``CommSpec.to_wire`` says, in input order, zeros for a
    parameter the block leaves without a gradient) (NOTE [a bucket per block]). Returns the
    reduction and what ``bw`` returns now."""
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
        buffer = aot.trace_into(graph, pack, present, fake_mode)
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
