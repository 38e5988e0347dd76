"""Where each DDP parameter is used in a Dynamo graph, and in which order gradients get ready."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Sequence

import torch
import torch.fx as fx

from .._compat.dynamo import is_higher_order_op


@dataclasses.dataclass(frozen=True)
class GraphParam:
    """One reducer parameter as seen by one Dynamo graph."""

    name: str
    """Fully qualified name in the DDP-wrapped module (``0.weight``, ``blocks.3.attn.w``)."""
    reducer_index: int
    """Index in DDP's reducer parameter list."""
    node: fx.Node
    """The placeholder (or get_attr) node that brings the parameter into the graph."""
    first_use: int
    """Position (in graph order) of the first node that reads the parameter; -1 if unused."""
    arg_position: int
    """Position of the parameter among the first user's flattened arguments (tie-break)."""
    nbytes: int
    dtype: torch.dtype
    in_higher_order_op: bool
    """The parameter is an operand of a higher-order op (checkpoint, torch.func, ...)."""
    tensor: torch.Tensor = dataclasses.field(repr=False, compare=False)


def _is_hop_node(node: fx.Node) -> bool:
    return node.op == "call_function" and is_higher_order_op(node.target)


def _flat_args(node: fx.Node) -> list[Any]:
    flat: list[Any] = []
    fx.node.map_arg((node.args, node.kwargs), lambda a: flat.append(a))
    return flat


@dataclasses.dataclass(frozen=True)
class ParamInput:
    """Which reducer parameter a node brings in, not where it is used (true across rewrites)."""

    name: str
    reducer_index: int
    node: fx.Node
    tensor: torch.Tensor = dataclasses.field(repr=False, compare=False)


def match_params(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    reducer_params: Iterable[tuple[str, torch.nn.Parameter]],
) -> list[ParamInput]:
    """The graph's inputs that are reducer parameters, by identity: placeholders whose example
    input is the ``nn.Parameter``, or ``get_attr`` nodes (``inline_inbuilt_nn_modules=False``)."""
    by_id = {id(p): (i, name, p) for i, (name, p) in enumerate(reducer_params)}
    found: list[ParamInput] = []
    for node, value in zip(gm.graph.find_nodes(op="placeholder"), example_inputs):
        if isinstance(value, torch.Tensor) and id(value) in by_id:
            index, name, param = by_id[id(value)]
            found.append(ParamInput(name, index, node, param))
    for node in gm.graph.find_nodes(op="get_attr"):
        value = getattr(gm, str(node.target), None)
        if isinstance(value, torch.Tensor) and id(value) in by_id:
            index, name, param = by_id[id(value)]
            found.append(ParamInput(name, index, node, param))
    return found


def params_in_graph(gm: fx.GraphModule, inputs: Iterable[ParamInput]) -> list[GraphParam]:
    """Where the graph now uses each matched parameter; one passed twice counts at its earliest use."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    best: dict[int, GraphParam] = {}
    for inp in inputs:
        node, param = inp.node, inp.tensor
        users = sorted(node.users, key=order.__getitem__)
        first = users[0] if users else None
        gp = GraphParam(
            name=inp.name,
            reducer_index=inp.reducer_index,
            node=node,
            first_use=order[first] if first is not None else -1,
            arg_position=_flat_args(first).index(node) if first is not None else 0,
            nbytes=param.numel() * param.element_size(),
            dtype=param.dtype,
            in_higher_order_op=any(_is_hop_node(u) for u in node.users),
            tensor=param,
        )
        prev = best.get(inp.reducer_index)
        if prev is None or (gp.first_use >= 0 and (prev.first_use < 0 or gp.first_use < prev.first_use)):
            best[inp.reducer_index] = gp
    return list(best.values())


def ready_order(params: Iterable[GraphParam]) -> list[GraphParam]:
    """Predicted gradient-ready order: reverse of first use in the forward graph. Ties go last
    argument first (eager autograd readies a linear's bias before its weight); unused ones last."""
    used = [p for p in params if p.first_use >= 0]
    unused = [p for p in params if p.first_use < 0]
    used.sort(key=lambda p: (p.first_use, p.arg_position), reverse=True)
    return used + sorted(unused, key=lambda p: p.reducer_index)


def higher_order_ops(gm: fx.GraphModule) -> list[str]:
    """Names of the higher-order ops captured in a graph (``tag_activation_checkpoint``, ...)."""
    return [str(getattr(n.target, "__name__", n.target)) for n in gm.graph.nodes if _is_hop_node(n)]
