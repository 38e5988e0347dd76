"""Repeated blocks in a Dynamo graph: where each starts and ends, and which pieces are identical.

A model built from a list of one block class (``nn.ModuleList`` of transformer layers, Hugging
Face decoder and encoder layers, a stage of identical residual blocks) leaves, in the graph
Dynamo captures of its whole forward, one run of nodes per block: Dynamo records on every node
the modules whose forward produced it (``meta["nn_module_stack"]``, outermost first), so the
nodes of ``layers.3`` are those whose outermost numbered entry is ``...layers.3``.
:func:`find_block_run` finds the longest such run whose blocks follow each other in graph order;
:func:`piece_signature` says when two pieces of a split graph are the same computation on other
tensors (the same nodes, constants and input layouts, whatever the nodes are called), so that
one compile serves both.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from .regions import outside_regions, transform_regions

_NUMBERED = re.compile(r"^(?P<parent>.+?)(?:\.(?P<dot>\d+)|\[(?P<bracket>\d+)\])$")


@dataclasses.dataclass(frozen=True)
class BlockRun:
    """Blocks of one module list, in graph order."""

    container: str
    """The list as Dynamo names it (``L['self'].model.layers``)."""
    block_class: str
    starts: tuple[int, ...]
    """Graph position of each block's first node."""
    end: int
    """Graph position of the last block's last node."""

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def name(self) -> str:
        """The list without Dynamo's frame prefix (``model.layers``)."""
        return re.sub(r"^[A-Z]\['[^']*'\]\.?", "", self.container) or self.container


def _outermost_numbered(node: fx.Node) -> tuple[str, int, str] | None:
    """``(list, index, block class)`` of the outermost numbered module a node belongs to."""
    stack = node.meta.get("nn_module_stack") or {}
    for qualified, cls in stack.values():
        m = _NUMBERED.match(str(qualified))
        if m:
            index = int(m.group("dot") if m.group("dot") is not None else m.group("bracket"))
            return m.group("parent"), index, getattr(cls, "__qualname__", str(cls))
    return None


def find_block_run(gm: fx.GraphModule, *, min_blocks: int = 2) -> tuple[BlockRun | None, str]:
    """The run of repeated blocks to share compiles over, or ``None`` and why there is none."""
    nodes = list(gm.graph.nodes)
    seen: dict[str, dict[int, list[int]]] = {}
    classes: dict[str, set[str]] = {}
    for pos, node in enumerate(nodes):
        if node.op in ("placeholder", "output") or not node.op.startswith("call_"):
            continue
        found = _outermost_numbered(node)
        if found is None:
            continue
        parent, index, cls = found
        seen.setdefault(parent, {}).setdefault(index, []).append(pos)
        classes.setdefault(parent, set()).add(cls)
    if not seen:
        return None, "no numbered submodules (an nn.ModuleList of blocks) in the graph"
    parent = max(seen, key=lambda p: len(seen[p]))
    blocks = seen[parent]
    if len(blocks) < min_blocks:
        return None, f"{parent} has {len(blocks)} block(s) in this graph"
    if len(classes[parent]) != 1:
        return None, f"{parent} holds blocks of {len(classes[parent])} classes"
    indices = sorted(blocks)
    if indices != list(range(indices[0], indices[0] + len(indices))):
        return None, f"{parent}: blocks {indices} are not consecutive in this graph"
    spans = [(min(blocks[i]), max(blocks[i])) for i in indices]
    for (_, end), (start, _) in zip(spans, spans[1:]):
        if start <= end:
            return None, f"{parent}: the blocks' nodes interleave in the graph"
    regions = transform_regions(gm)
    starts = tuple(outside_regions(s, regions) for s, _ in spans)
    if list(starts) != [s for s, _ in spans]:
        return None, f"{parent}: a torch.func transform spans a block boundary"
    return BlockRun(parent, next(iter(classes[parent])), starts, spans[-1][1]), ""


def piece_of(run: BlockRun, position: int) -> int:
    """The piece a node at ``position`` goes to: 0 before the first block, ``k + 1`` for block
    ``k`` (with whatever follows it up to the next block), ``len(run) + 1`` after the last."""
    if position < run.starts[0]:
        return 0
    if position > run.end:
        return len(run) + 1
    k = 0
    while k + 1 < len(run) and run.starts[k + 1] <= position:
        k += 1
    return k + 1


Opaque = Callable[[fx.Node], "tuple[Any, Any] | None"]
"""For a call whose target's computation is not in the graph: ``(what it computes, its args
that take part)``, else ``None`` (keyed as any other node)."""


def piece_signature(gm: fx.GraphModule, inputs: Sequence[Any], *, opaque: Opaque | None = None) -> tuple:
    """What a compiled piece depends on: its nodes (ops, constants, wiring, by position, not
    by name) and the layout of its inputs. Two pieces with equal signatures compute the same
    function of their inputs, so one compiled piece serves both. ``opaque``: what a call
    computes where its target alone does not say (a block called as one op)."""
    layout = tuple(_value_key(v) for v in inputs)
    return layout, _graph_key(gm, opaque)


def _graph_key(gm: fx.GraphModule, opaque: Opaque | None) -> tuple:
    index = {node: i for i, node in enumerate(gm.graph.nodes)}
    rows = []
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            target = getattr(gm, str(node.target))
            rows.append(
                (
                    "get_attr",
                    _graph_key(target, opaque) if isinstance(target, fx.GraphModule) else ("object", id(target)),
                )
            )
            continue
        called = opaque(node) if opaque is not None and node.op == "call_function" else None
        if called is not None:
            computation, args = called
            rows.append(("opaque", computation, _arg_key(args, index)))
            continue
        if node.op == "call_module":
            target = _graph_key(getattr(gm, str(node.target)), opaque)
        elif node.op == "call_function":
            target = _callable_key(node.target)
        else:
            target = str(node.target) if node.op == "call_method" else None
        rows.append((node.op, target, _arg_key(node.args, index), _arg_key(node.kwargs, index)))
    return tuple(rows)


def _callable_key(target: Any) -> tuple[str, str, str]:
    """The same function (or op overload) gives the same key in every piece."""
    return (str(getattr(target, "__module__", "")), str(getattr(target, "__qualname__", "")), repr(target))


def _arg_key(arg: Any, index: dict[fx.Node, int]) -> Any:
    if isinstance(arg, fx.Node):
        return ("node", index[arg])
    if isinstance(arg, (tuple, list)):
        return (type(arg).__name__, tuple(_arg_key(a, index) for a in arg))
    if isinstance(arg, dict):
        return ("dict", tuple((k, _arg_key(v, index)) for k, v in arg.items()))
    if isinstance(arg, slice):
        return ("slice", _arg_key((arg.start, arg.stop, arg.step), index))
    if isinstance(arg, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return str(arg)
    if isinstance(arg, (int, float, bool, str, type(None))):
        return (type(arg).__name__, repr(arg))
    return ("object", type(arg).__qualname__, repr(arg))


def _value_key(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (
            "tensor",
            tuple(value.shape),
            tuple(value.stride()),
            str(value.dtype),
            str(value.device),
            value.requires_grad,
        )
    if isinstance(value, torch.SymInt):
        return ("symint", str(value))
    return ("value", type(value).__name__, repr(value))
