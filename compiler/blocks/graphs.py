"""A shared block's forward and backward graphs, rewritten in pure FX before they compile
(NOTE [a shared block in stages]); ``NotShareable`` says why a block cannot be shared."""

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
from ...distributed import plan
from ...distributed.fused.cache_keys import source_key
from ...distributed.fused.sync import CommSpec, unflatten

TensorMeta = tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.device]


class NotShareable(Exception):
    pass


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """What the shared forward returns and the backward takes and returns. ``copied``: outputs
    viewing an input or earlier output (an op's outputs may not alias); ``roots``: each distinct
    tensor the backward reads or views (``input``/``output``/``base``, which); ``grads``: one per
    input (``None``: none), with a ``BlockWire`` the others' then the flat buffer."""

    n_user: int
    copied: frozenset[int]
    roots: tuple[tuple[str, int], ...]
    outputs: tuple[TensorMeta, ...]
    grads: tuple[TensorMeta | None, ...]
    input_strides: tuple[tuple[int, ...], ...]
    forward_layouts: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    present: tuple[int, ...]  # the positions in ``grads`` the backward returns


# Ops autocast leaves alone: moved out, they compute the same when the graph around is traced again.
_MOVABLE = frozenset(
    name if "::" in name else f"aten::{name}"
    for name in (
        "prims::convert_element_type where scalar_tensor full full_like zeros zeros_like ones ones_like arange "
        "masked_fill logical_not logical_and logical_or eq ne lt le gt ge bitwise_not bitwise_and bitwise_or add sub "
        "mul neg clone expand unsqueeze squeeze view reshape permute slice select alias _to_copy"
    ).split()
)


def _output(gm: fx.GraphModule) -> fx.Node:
    return next(iter(gm.graph.find_nodes(op="output")))


def _recompile(gm: fx.GraphModule, outputs: list[Any] | None = None) -> None:
    if outputs is not None:
        _output(gm).args = (tuple(outputs),)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()


def move_out(fw: fx.GraphModule, bw: fx.GraphModule, invariant: tuple[int, ...], n_user: int) -> fx.GraphModule | None:
    """Move what ``fw`` computes from its inputs at ``invariant`` alone (not its first ``n_user``
    outputs) out: ``fw`` takes it as its last inputs; the graph computing it, or ``None`` if nothing."""
    placeholders = list(fw.graph.find_nodes(op="placeholder"))
    returned = set(_output(fw).args[0][:n_user])
    given = {placeholders[i] for i in invariant}
    movable: dict[fx.Node, bool] = {}  # -> reads one of ``given`` (not constants only)
    for node in fw.graph.nodes:
        ins = node.all_input_nodes
        if node.op == "call_function" and cc.op_name(node) in _MOVABLE and all(a in given or a in movable for a in ins):
            movable[node] = any(a in given or movable.get(a, False) for a in ins)
    # What the block goes on to read that costs a kernel (a view is free: it stays).
    moved = [n for n, reads in movable.items() if reads and n not in returned and not aot.aliases_an_input(n)]
    moved = [n for n in moved if any(u not in movable or aot.aliases_an_input(u) for u in n.users)]
    if not moved:
        return None
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in [*(placeholders[i] for i in invariant), *movable]:  # pure: what ``moved`` does not read goes
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[n] for n in moved))
    graph.eliminate_dead_code()
    with fw.graph.inserting_before(placeholders[-1].next):
        for j, node in enumerate(moved):
            taken = fw.graph.placeholder(f"before_blocks_{j}")
            taken.meta["val"] = node.meta["val"]
            node.replace_all_uses_with(taken)
    _recompile(fw)
    _recompile(bw, [*_output(bw).args[0], *[None] * len(moved)])
    return fx.GraphModule(fw, graph)


def drop_unread(fw: fx.GraphModule, bw: fx.GraphModule) -> tuple[int, ...] | None:
    """Drop ``fw``'s inputs it does not read and ``bw`` gives no gradient; the positions kept, or
    ``None`` where all are. A call passes only those: Inductor copies a view given to an op."""
    placeholders = list(fw.graph.find_nodes(op="placeholder"))
    grads = list(_output(bw).args[0])
    if len(grads) != len(placeholders):
        raise AssertionError(f"expected a gradient place per forward input ({len(placeholders)}), got {len(grads)}")
    kept = tuple(i for i, p in enumerate(placeholders) if p.users or grads[i] is not None)
    if len(kept) == len(placeholders):
        return None
    for i in set(range(len(placeholders))) - set(kept):
        fw.graph.erase_node(placeholders[i])
    _recompile(fw)
    _recompile(bw, [grads[i] for i in kept])
    return kept


def insert_graph(graph: fx.Graph, before: fx.GraphModule, args: list[fx.Node]) -> list[fx.Node]:
    """``before`` copied into ``graph`` on ``args``; its outputs, fake values also as ``example_value``."""
    val_map: dict[fx.Node, Any] = dict(zip(before.graph.find_nodes(op="placeholder"), args))
    out = graph.graph_copy(before.graph, val_map)
    for node in val_map.values():
        if node not in args and "val" in node.meta:
            node.meta.setdefault("example_value", node.meta["val"])
    return list(out)


def plan_layout(n_user: int, fw: fx.GraphModule, bw: fx.GraphModule, fake_mode: Any) -> BlockLayout:
    """The forward returns the block's ``n_user`` outputs and each other distinct non-view tensor the
    backward reads, once; the backward applies the view ops again (NOTE [one compile per block])."""
    fw_out = list(_output(fw).args[0])
    placeholders = {p: i for i, p in enumerate(fw.graph.find_nodes(op="placeholder"))}
    user, bases, saved = fw_out[:n_user], [], []
    owner: dict[fx.Node, int] = {}  # a root -> the output that hands it out
    copied = set()
    for j, node in enumerate(user):
        root, _ = _view_chain(node)
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
            if user[j] is not root:
                v = root.meta["val"]
                geometry = (list(v.shape), list(v.stride()), v.storage_offset())
                views = [(torch.ops.aten.as_strided.default, (user[j], *geometry), {}), *views]
            saved.append(("output", j, views))
        else:
            if root not in bases:
                bases.append(root)
            saved.append(("base", bases.index(root), views))
    _recompile(fw, user + bases)
    n_tangents = len(bw.graph.find_nodes(op="placeholder")) - len(saved)
    if n_tangents != sum(1 for n in user if n.meta["val"].is_floating_point()):
        raise NotShareable("the backward takes gradients of other outputs than the block's floating-point ones")
    pools = {"input": list(placeholders), "output": user, "base": bases}
    roots = sorted({(kind, i) for kind, i, _ in saved}, key=lambda r: (("input", "output", "base").index(r[0]), r[1]))
    _views_into_backward(bw, saved, {r: pools[r[0]][r[1]].meta["val"] for r in roots}, fake_mode)
    grads = tuple(tensor_meta(n) if isinstance(n, fx.Node) else None for n in _output(bw).args[0])
    return BlockLayout(
        n_user=n_user,
        copied=frozenset(copied),
        roots=tuple(roots),
        outputs=tuple(tensor_meta(n) for n in user + bases),
        grads=grads,
        input_strides=tuple(tuple(n.meta["val"].stride()) for n in bw.graph.find_nodes(op="placeholder")),
        forward_layouts=tuple((tuple(p.meta["val"].shape), tuple(p.meta["val"].stride())) for p in placeholders),
        present=tuple(i for i, meta in enumerate(grads) if meta is not None),
    )


def _views_into_backward(bw: fx.GraphModule, saved: list[tuple], roots: dict[tuple, Any], fake_mode: Any) -> None:
    """``bw`` takes ``roots`` instead of the ``saved`` tensors, viewed from them at its start."""
    graph = bw.graph
    placeholders = list(graph.find_nodes(op="placeholder"))
    with graph.inserting_before(placeholders[0]):
        root_nodes = {(kind, i): graph.placeholder(f"saved_{kind}_{i}") for kind, i in roots}
    for root, node in root_nodes.items():
        node.meta["val"] = roots[root]
    first_op = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first_op), fake_mode:
        for ph, (kind, i, views) in zip(placeholders, saved):
            value = root_nodes[(kind, i)]
            for target, (_, *args), kwargs in views:  # each view's first argument: the tensor it views
                if any(isinstance(a, fx.Node) for a in args):
                    raise NotShareable(f"a tensor the backward reads is a view ({target}) taking a traced value")
                node = graph.call_function(target, (value, *args), dict(kwargs))
                node.meta["val"] = target(value.meta["val"], *args, **kwargs)
                value = node
            ph.replace_all_uses_with(value)
            graph.erase_node(ph)
    _recompile(bw)


def _view_chain(node: Any) -> tuple[Any, list[tuple[Any, tuple, dict]]]:
    """The tensor ``node`` views, and the view ops from it to ``node``."""
    views = []
    while isinstance(node, fx.Node) and aot.aliases_an_input(node):
        views.append((node.target, node.args, node.kwargs))
        node = node.args[0]
    return node, views[::-1]


def tensor_meta(node: fx.Node) -> TensorMeta:
    v = node.meta["val"]
    return tuple(v.shape), tuple(v.stride()), v.dtype, v.device


@dataclasses.dataclass(frozen=True)
class BlockWire:
    """``fused``: the inputs whose gradients the block reduces itself (NOTE [a bucket per block])."""

    reduced: tuple[int, ...]
    spec: CommSpec
    reduced_shapes: tuple[torch.Size, ...]
    reduced_dtypes: tuple[torch.dtype, ...]


def grads_onto_wire(
    bw: fx.GraphModule, wire: BlockWire, params: list[torch.Tensor], fake_mode: Any, *, decompose: bool
) -> None:
    """``bw`` returns the gradients of the ``wire.reduced`` inputs (fakes ``params``) last, as one
    flat ``CommSpec.to_wire`` buffer (zeros where none, as ``BucketSync``)."""
    out_node = _output(bw)
    outs = list(out_node.args[0])
    grads = [outs[i] for i in wire.reduced]

    def pack(*given: torch.Tensor) -> torch.Tensor:
        it = iter(given)
        full = [next(it) if isinstance(g, fx.Node) else torch.zeros_like(p) for g, p in zip(grads, params)]
        # Traced while the forward compiles, under the forward's autocast if any.
        with torch.autocast(params[0].device.type, enabled=False):
            return torch.cat([wire.spec.to_wire(g.reshape(-1)) for g in full])

    with bw.graph.inserting_before(out_node):
        present = [g for g in grads if isinstance(g, fx.Node)]
        buffer = aot.trace_into(bw.graph, pack, present, fake_mode, decompose=decompose)
    _recompile(bw, [o for i, o in enumerate(outs) if i not in wire.reduced] + [buffer])


def reduced_grads(wire: BlockWire, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Every input's gradient, those of ``wire.reduced`` all-reduced from the flat buffer last."""
    *others, flat = grads
    reduced, dtypes = wire.spec.all_reduce(flat), wire.reduced_dtypes
    if wire.spec.comm_dtype is None:  # reduced in the gradients' own dtype
        parts = unflatten(reduced, wire.reduced_shapes)
    elif len(set(dtypes)) == 1:  # one cast; the gradients view its result
        parts = unflatten(reduced.to(dtypes[0]), wire.reduced_shapes)
    else:  # each to its own parameter's dtype, as DDP's bucket of that dtype takes it
        parts = [g.to(dtype) for g, dtype in zip(unflatten(reduced, wire.reduced_shapes), dtypes)]
    params, rest = iter(parts), iter(others)
    return [next(params) if i in wire.reduced else next(rest) for i in range(len(others) + len(wire.reduced))]


# NOTE [block reductions grouped]: a bucket per block (NOTE [a bucket per block]) is a collective
# per block, each costing host time whatever its size (NOTE [fused bucket sizes]). So a post-grad
# pass groups their all-reduces in issue order by the fused rule's sizes (``plan.overlap_limits``):
# one ``all_reduce_coalesced`` each, issued after its last block's backward, scheduled as any
# collective (NOTE [late waits]). A user's own Inductor ``post_grad_custom_post_pass`` replaces it.


def group_block_reductions(graph: fx.Graph, *, producer: str, floor_bytes: int) -> None:
    """Group the all-reduces of the flat buffers ``producer`` (``namespace::name``) returns."""
    nodes = [
        n
        for n in graph.nodes
        if cc.is_all_reduce(n)
        and isinstance(flat := n.args[0], fx.Node)
        and flat.target is operator.getitem
        and cc.op_name(flat.args[0]) == producer
    ]
    if len(nodes) < 2:
        return
    values = [n.args[0].meta["val"] for n in nodes]
    sizes = [v.numel() * v.element_size() for v in values]
    limits = plan.overlap_limits(sum(sizes), floor_bytes)
    groups: list[list[int]] = [[]]
    for i in range(len(nodes)):
        if groups[-1] and values[i - 1].dtype != values[i].dtype:  # one dtype per coalesced call
            groups.append([])
        groups[-1].append(i)
        # As DDP's reducer closes a bucket: once its bytes reach the cap (the last one repeats).
        if sum(sizes[k] for k in groups[-1]) >= limits[min(len(groups) - 1, len(limits) - 1)]:
            groups.append([])
    cc.coalesce_all_reduces(graph, [[nodes[k] for k in g] for g in groups if len(g) > 1])


def grouping_pass(producer: str, floor_bytes: int) -> Any:
    """:func:`group_block_reductions` as a post-grad pass, keyed (NOTE [compile cache keys])."""
    key = f"{source_key(plan, cc, sys.modules[__name__])}-{producer}-{floor_bytes}"
    return cc.post_grad_pass(functools.partial(group_block_reductions, producer=producer, floor_bytes=floor_bytes), key)
