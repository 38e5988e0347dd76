"""A shared block's graphs, analysed and rewritten: pure FX, nothing compiled (``compiler/blocks.py``
compiles them and calls them, NOTE [one compile per block]).

The nodes of each block of a run (``block_parts``), a fake value of every node (``fake_values``),
the inputs every block reads the same (``invariant_inputs``) and what moves out of the block's
forward because of them (``move_out``, NOTE [computed once before the blocks]), the inputs the
forward then reads no more (``drop_unread``), and how the forward hands the backward what it
reads (``plan_layout``). ``NotShareable`` says why a block
cannot be shared; the whole graph then compiles it as before.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import torch
import torch.fx as fx

from .._compat import aot
from .blocks import BlockRun, piece_of

TensorMeta = tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.device]


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """What the shared forward returns and the shared backward takes and returns (``plan_layout``)."""

    n_user: int
    copied: frozenset[int]
    """Outputs returned as a copy: views of an input, or of the same tensor as an earlier
    output (an operation's outputs may not alias its inputs or each other)."""
    roots: tuple[tuple[str, int], ...]
    """What the backward takes before the gradients: each distinct tensor it reads or views, as
    (``input``, ``output`` or ``base``, which one); the backward graph applies the view ops."""
    n_bases: int
    outputs: tuple[TensorMeta, ...]
    grads: tuple[TensorMeta | None, ...]
    """What the backward returns: a gradient per input (``None`` for none), or with a
    ``BlockWire``, the other inputs' and then the flat buffer."""
    n_tangents: int
    """Gradients the backward takes: one per floating-point output, in order."""
    input_strides: tuple[tuple[int, ...], ...]
    """The strides the backward was compiled for, per input."""
    forward_layouts: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    """The shape and strides of each input the forward was compiled for."""

    @functools.cached_property
    def present(self) -> tuple[int, ...]:
        """The positions in ``grads`` the backward returns a tensor at."""
        return tuple(i for i, meta in enumerate(self.grads) if meta is not None)


@dataclasses.dataclass(frozen=True)
class MovedOut:
    """The part of the block's forward moved into the graph around the blocks (NOTE [computed once
    before the blocks]): ``before`` takes the block's inputs at ``invariant`` and returns what
    every call of the block then takes after its own inputs."""

    before: fx.GraphModule
    invariant: tuple[int, ...]


class NotShareable(Exception):
    pass


def block_parts(gm: fx.GraphModule, run: BlockRun) -> list[list[fx.Node]]:
    """Each block's nodes, in graph order. An attribute read (a checkpointed body: Dynamo puts
    its ``get_attr`` before the block that calls it) goes with the block that reads it."""
    nodes = list(gm.graph.nodes)
    piece = {node: piece_of(run, pos) for pos, node in enumerate(nodes)}
    for node in nodes:
        if node.op == "get_attr":
            readers = {piece[u] for u in node.users}
            if len(readers) == 1:
                piece[node] = readers.pop()
    parts: list[list[fx.Node]] = [[] for _ in range(len(run))]
    for node in nodes:
        if 1 <= piece[node] <= len(run) and node.op not in ("placeholder", "output"):
            parts[piece[node] - 1].append(node)
    return parts


# Ops that autocast leaves alone (no precision rule): moved out of a block (NOTE [computed once
# before the blocks]), they compute the same when the graph around the blocks is traced again.
_MOVABLE = frozenset(
    [
        *(
            f"aten::{name}"
            for name in (
                "where", "scalar_tensor", "full", "full_like", "zeros", "zeros_like", "ones", "ones_like",
                "arange", "masked_fill", "logical_not", "logical_and", "logical_or", "eq", "ne", "lt", "le",
                "gt", "ge", "bitwise_not", "bitwise_and", "bitwise_or", "add", "sub", "mul", "neg", "clone",
                "expand", "unsqueeze", "squeeze", "view", "reshape", "permute", "slice", "select", "alias",
                "_to_copy",
            )
        ),
        "prims::convert_element_type",
    ]
)  # fmt: skip


def op_name(node: fx.Node) -> str:
    """``aten::where`` for ``aten.where.self``: an operator's name without its overload."""
    name = getattr(node.target, "name", None)
    return name().split(".")[0] if callable(name) else str(node.target)


def _movable(node: fx.Node) -> bool:
    return node.op == "call_function" and op_name(node) in _MOVABLE


def invariant_inputs(
    graphs: list[tuple[fx.GraphModule, tuple[fx.Node, ...], tuple[fx.Node, ...]]],
    signatures: list[tuple],
    repeated: set[tuple],
    values: dict[fx.Node, Any],
) -> dict[tuple, tuple[int, ...]]:
    """Per repeated signature, the inputs every block of it reads the same: one node at that input
    of each, a tensor without a gradient (NOTE [computed once before the blocks])."""
    out = {}
    for signature in repeated:
        calls = [inputs for (_, inputs, _), sig in zip(graphs, signatures) if sig == signature]
        out[signature] = tuple(
            i
            for i, node in enumerate(calls[0])
            if all(inputs[i] is node for inputs in calls)
            and isinstance(values[node], torch.Tensor)
            and not values[node].requires_grad
        )
    return out


def move_out(fw: fx.GraphModule, bw: fx.GraphModule, invariant: tuple[int, ...], *, n_user: int) -> MovedOut | None:
    """Move what ``fw`` computes from its inputs at ``invariant`` alone out of it (NOTE [computed
    once before the blocks]): ``fw`` then takes those values as its last inputs, ``bw`` gives them
    no gradient. Returns the moved part (a graph taking the ``invariant`` inputs), or ``None``
    where nothing moves. A value among the block's first ``n_user`` outputs (the block's own)
    stays: an output that is an input is copied at every call."""
    placeholders = list(fw.graph.find_nodes(op="placeholder"))
    returned = set(next(iter(fw.graph.find_nodes(op="output"))).args[0][:n_user])
    given = {placeholders[i] for i in invariant}
    movable: dict[fx.Node, bool] = {}  # -> reads one of ``given`` (not constants only)
    for node in fw.graph.nodes:
        if _movable(node) and all(a in given or a in movable for a in node.all_input_nodes):
            movable[node] = any(a in given or movable.get(a, False) for a in node.all_input_nodes)
    # Moved: the values the block goes on to read that cost a kernel (a view stays: it is free,
    # and an input of the block would be the view's layout).
    moved = [
        n
        for n, reads in movable.items()
        if reads
        and n not in returned
        and not aot.aliases_an_input(n)
        and any(u not in movable or aot.aliases_an_input(u) for u in n.users)
    ]
    if not moved:
        return None
    needed: set[fx.Node] = set()
    stack = list(moved)
    while stack:
        node = stack.pop()
        if node not in needed and node not in given:
            needed.add(node)
            stack.extend(node.all_input_nodes)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i in invariant:
        env[placeholders[i]] = graph.placeholder(placeholders[i].name)
        env[placeholders[i]].meta = dict(placeholders[i].meta)
    for node in fw.graph.nodes:
        if node in needed:
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[n] for n in moved))
    anchor = placeholders[-1]
    for j, node in enumerate(moved):
        with fw.graph.inserting_after(anchor):
            anchor = fw.graph.placeholder(f"before_blocks_{j}")
        anchor.meta["val"] = node.meta["val"]
        node.replace_all_uses_with(anchor)
    fw.graph.eliminate_dead_code()
    fw.graph.lint()
    fw.recompile()
    out = next(iter(bw.graph.find_nodes(op="output")))
    out.args = (tuple(out.args[0]) + (None,) * len(moved),)
    bw.recompile()
    return MovedOut(fx.GraphModule(fw, graph), invariant)


def drop_unread(fw: fx.GraphModule, bw: fx.GraphModule) -> tuple[int, ...] | None:
    """Take out of ``fw`` the inputs it does not read and ``bw`` gives no gradient (what only the
    moved part read, NOTE [computed once before the blocks]; an argument the block ignores), and
    their places in ``bw``'s outputs. Returns the positions of the inputs kept, or ``None`` where
    every input is read. A block's call then passes only those: Inductor copies a view given to
    an operator at every call (HF Llama's boolean mask, expanded: a kernel and an allocation per
    block and step)."""
    placeholders = list(fw.graph.find_nodes(op="placeholder"))
    out = next(iter(bw.graph.find_nodes(op="output")))
    grads = list(out.args[0])
    if len(grads) != len(placeholders):
        raise AssertionError(f"expected a gradient place per forward input ({len(placeholders)}), got {len(grads)}")
    unread = [i for i, p in enumerate(placeholders) if not p.users and grads[i] is None]
    if not unread:
        return None
    for i in unread:
        fw.graph.erase_node(placeholders[i])
    fw.graph.lint()
    fw.recompile()
    gone = set(unread)
    kept = tuple(i for i in range(len(placeholders)) if i not in gone)
    out.args = (tuple(grads[i] for i in kept),)
    bw.recompile()
    return kept


def insert_graph(graph: fx.Graph, before: fx.GraphModule, args: list[fx.Node]) -> list[fx.Node]:
    """``before``'s nodes copied into ``graph`` at its insertion point, on ``args``; the nodes of
    its outputs. Each keeps its fake value, also as Dynamo's (``example_value``)."""
    val_map: dict[fx.Node, Any] = dict(zip(before.graph.find_nodes(op="placeholder"), args))
    out = graph.graph_copy(before.graph, val_map)
    for node in val_map.values():
        if node not in args and "val" in node.meta:
            node.meta.setdefault("example_value", node.meta["val"])
    return list(out)


def plan_layout(sub: fx.GraphModule, fw: fx.GraphModule, bw: fx.GraphModule, fake_mode: Any) -> BlockLayout:
    """How the shared forward hands the backward what it reads (see NOTE [one compile per block]):
    the forward graph returns the block's outputs and each other distinct non-view tensor the
    backward reads once; every tensor the backward reads is an input, an output or such a base,
    seen through view ops that the backward graph applies again at its start."""
    n_user = len(user_outputs(sub))
    out_node = next(iter(fw.graph.find_nodes(op="output")))
    fw_out = list(out_node.args[0])
    placeholders = {p: i for i, p in enumerate(fw.graph.find_nodes(op="placeholder"))}
    user, bases, saved = fw_out[:n_user], [], []
    owner: dict[fx.Node, int] = {}  # a root -> the output that hands it out
    copied = set()
    for j, node in enumerate(user):
        root, views = _view_chain(node)
        if root in placeholders or root in owner:
            copied.add(j)
        else:
            owner[root] = j
    for node in fw_out[n_user:]:
        root, views = _view_chain(node)
        if root in placeholders:
            saved.append(("input", placeholders[root], views))
        elif root in owner:
            j = owner[root]
            back = (
                []
                if user[j] is root
                else [(torch.ops.aten.as_strided.default, (user[j], *_geometry(root)), {}, user[j])]
            )
            saved.append(("output", j, back + views))
        else:
            if root not in bases:
                bases.append(root)
            saved.append(("base", bases.index(root), views))
    out_node.args = (tuple(user + bases),)
    fw.graph.eliminate_dead_code()
    fw.recompile()
    n_tangents = len(bw.graph.find_nodes(op="placeholder")) - len(saved)
    if n_tangents != sum(1 for n in user if n.meta["val"].is_floating_point()):
        raise NotShareable("the backward takes gradients of other outputs than the block's floating-point ones")
    pools = {"input": list(placeholders), "output": user, "base": bases}
    roots = sorted({(kind, i) for kind, i, _ in saved}, key=lambda r: (("input", "output", "base").index(r[0]), r[1]))
    _views_into_backward(bw, saved, {r: pools[r[0]][r[1]].meta["val"] for r in roots}, fake_mode)
    bw_inputs = list(bw.graph.find_nodes(op="placeholder"))
    bw_out = list(next(iter(bw.graph.find_nodes(op="output"))).args[0])
    return BlockLayout(
        n_user=n_user,
        copied=frozenset(copied),
        roots=tuple(roots),
        n_bases=len(bases),
        outputs=tuple(tensor_meta(n) for n in user + bases),
        grads=tuple(tensor_meta(n) if isinstance(n, fx.Node) else None for n in bw_out),
        n_tangents=n_tangents,
        input_strides=tuple(tuple(n.meta["val"].stride()) for n in bw_inputs),
        forward_layouts=tuple((tuple(p.meta["val"].shape), tuple(p.meta["val"].stride())) for p in placeholders),
    )


def _views_into_backward(
    bw: fx.GraphModule,
    saved: list[tuple[str, int, list[tuple[Any, tuple, dict, Any]]]],
    roots: dict[tuple[str, int], Any],
    fake_mode: Any,
) -> None:
    """Rewrite ``bw`` in place to take ``roots`` (one placeholder each, in that order) in place of
    the ``saved`` tensors, which it makes from them with their view ops at the start of its graph:
    the views are then free reinterpretations inside the compiled backward, not nodes of the graph
    around every block."""
    graph = bw.graph
    placeholders = list(graph.find_nodes(op="placeholder"))
    with graph.inserting_before(placeholders[0]):
        root_nodes = {}
        for kind, i in roots:
            root_nodes[(kind, i)] = node = graph.placeholder(f"saved_{kind}_{i}")
            node.meta["val"] = roots[(kind, i)]
    first_op = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first_op), fake_mode:
        for ph, (kind, i, views) in zip(placeholders, saved):
            value = root_nodes[(kind, i)]
            for target, args, kwargs, parent in views:
                args = tuple(value if a is parent else a for a in args)
                if any(isinstance(a, fx.Node) and a is not value for a in args):
                    raise NotShareable(f"a tensor the backward reads is a view ({target}) taking a traced value")
                node = graph.call_function(target, args, dict(kwargs))
                node.meta["val"] = target(*[value.meta["val"] if a is value else a for a in args], **kwargs)
                value = node
            ph.replace_all_uses_with(value)
            graph.erase_node(ph)
    graph.lint()
    bw.recompile()


def _geometry(node: fx.Node) -> tuple[list[int], list[int], int]:
    v = node.meta["val"]
    return list(v.shape), list(v.stride()), v.storage_offset()


def _view_chain(node: Any) -> tuple[Any, list[tuple[Any, tuple, dict, Any]]]:
    """The tensor ``node`` is a view of (through view ops), and those ops from it to ``node``."""
    views = []
    while isinstance(node, fx.Node) and aot.aliases_an_input(node):
        views.append((node.target, node.args, node.kwargs, node.args[0]))
        node = node.args[0]
    return node, list(reversed(views))


def tensor_meta(node: fx.Node) -> TensorMeta:
    v = node.meta["val"]
    return tuple(v.shape), tuple(v.stride()), v.dtype, v.device


def user_outputs(sub: fx.GraphModule) -> list[Any]:
    out = next(iter(sub.graph.find_nodes(op="output"))).args[0]
    return list(out) if isinstance(out, (tuple, list)) else [out]


def fake_values(gm: fx.GraphModule, example_inputs: Sequence[Any], fake_mode: Any) -> dict[fx.Node, Any]:
    """A fake value of every node: Dynamo's own (``example_value``), placeholders from the
    example inputs (parameters made fake)."""
    out: dict[fx.Node, Any] = {}
    for node, value in zip(gm.graph.find_nodes(op="placeholder"), example_inputs):
        if isinstance(value, torch.Tensor) and not aot.is_fake(value):
            value = fake_mode.from_tensor(value, static_shapes=True)
        out[node] = value
    for node in gm.graph.nodes:
        if node not in out:
            out[node] = node.meta.get("example_value", node.meta.get("val"))
    return out


def is_symbolic(t: torch.Tensor) -> bool:
    return any(isinstance(d, torch.SymInt) for d in t.shape)


def mode_switch_across(gm: fx.GraphModule, run: BlockRun) -> str | None:
    """Why an autocast or grad-mode switch makes the blocks unshareable: one that is open at a
    block's start (it would not be in the block's own graph), or one left open inside a block."""
    depth = 0
    starts = set(run.starts)
    for pos, node in enumerate(gm.graph.nodes):
        if pos in starts and depth:
            return "an autocast or grad-mode region spans the blocks (entered before a block starts)"
        name = str(getattr(node.target, "__name__", node.target)) if node.op == "call_function" else ""
        if name in ("_enter_autocast",):
            depth += 1
        elif name in ("_exit_autocast",):
            depth -= 1
        elif name == "_set_grad_enabled" and run.starts[0] <= pos <= run.end:
            return "the blocks switch grad mode"
    return None
