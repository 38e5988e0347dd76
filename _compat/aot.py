"""AOTAutograd and Inductor entry points for compiling one block of a graph on its own
(``compiler/blocks.py``).

Checked on torch 2.11.0 (device machines), 2.13.0 and 2.15.0 (CPU).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch
import torch._guards
import torch.fx as fx


def partition(
    gm: fx.GraphModule, example_inputs: Sequence[Any], fake_mode: Any, *, decompose: bool
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """The forward and backward graphs AOTAutograd makes of ``gm`` (traced with its fake
    ``example_inputs``; Inductor's decompositions where ``decompose``), split by its min-cut
    partitioner, as ``torch.compile`` would split them. Nothing is compiled: AOTAutograd's own
    runtime wrapper is not used, the two graphs are."""
    from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    captured: dict[str, fx.GraphModule] = {}

    def split(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
        fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        captured["fw"], captured["bw"] = fw, bw
        return fw, bw

    def nothing(g: fx.GraphModule, _inputs: Any) -> Callable[..., Any]:
        return make_boxed_func(g.forward)

    gm.meta.pop("dynamo_compile_id", None)  # a graph of bucketwise's, not Dynamo's
    for node in gm.graph.find_nodes(op="placeholder"):
        node._dynamo_source = None
    decompositions = None
    if decompose:
        from torch._inductor.decomposition import select_decomp_table

        decompositions = select_decomp_table()
    with torch._guards.tracing(torch._guards.TracingContext(fake_mode)):
        aot_module_simplified(
            gm,
            list(example_inputs),
            fw_compiler=nothing,
            bw_compiler=nothing,
            partition_fn=split,
            decompositions=decompositions,
        )
    if "bw" not in captured:
        raise RuntimeError("AOTAutograd made no backward graph (no input requires grad)")
    return captured["fw"], captured["bw"]


def inductor_compile(
    gm: fx.GraphModule, example_inputs: Sequence[Any], fake_mode: Any, *, backward: bool, config_patches: dict
) -> Callable[[list[Any]], Any]:
    """``gm`` (an AOTAutograd forward or backward graph) compiled by Inductor, boxed: call it
    with a list of inputs, which it empties. Its outputs have the strides of ``gm``'s."""
    from torch._inductor.compile_fx import compile_fx_inner

    # Every output keeps the strides of the traced graph (as a user-visible output does): the
    # graph that calls this one was traced against them.
    out = next(iter(gm.graph.find_nodes(op="output")))
    out.meta["user_visible_output_idxs"] = [i for i, node in enumerate(out.args[0]) if isinstance(node, fx.Node)]
    with torch._guards.tracing(torch._guards.TracingContext(fake_mode)), torch._inductor.config.patch(config_patches):
        return compile_fx_inner(gm, list(example_inputs), is_backward=backward)


def trace_into(graph: fx.Graph, fn: Callable[..., Any], args: Sequence[fx.Node], fake_mode: Any) -> fx.Node:
    """``fn(*args)`` traced to aten ops (``make_fx`` on the nodes' fake values) and copied into
    ``graph`` at its insertion point; returns the node of its one tensor result."""
    from torch.fx.experimental.proxy_tensor import make_fx

    with fake_mode:
        traced = make_fx(fn)(*[a.meta["val"] for a in args])
    val_map: dict[fx.Node, Any] = dict(zip(traced.graph.find_nodes(op="placeholder"), args))
    return graph.graph_copy(traced.graph, val_map)


def boxed(gm: fx.GraphModule) -> Callable[[list[Any]], Any]:
    """``gm`` run as it is (``aot_eager``), boxed like an Inductor-compiled graph."""

    def run(args: list[Any]) -> Any:
        values = list(args)
        args.clear()
        return gm(*values)

    return run


def aliases_an_input(node: fx.Node) -> bool:
    """An aten op node whose output is a view of one of its inputs (its schema marks the return
    ``Tensor(a)``, not written to), or a ``getitem`` of such an op's list of views (``split``)."""
    import operator

    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        first = node.args[0]
        return isinstance(first, fx.Node) and aliases_an_input(first)
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    info = schema.returns[0].alias_info
    return info is not None and not info.is_write


@contextlib.contextmanager
def dynamo_sources_kept(gm: fx.GraphModule) -> Iterator[None]:
    """Dynamo's source record of each placeholder (``_dynamo_source``, which AOTAutograd reads to
    find parameters) survives a rewrite of the graph around it."""
    saved = {
        node: node._dynamo_source for node in gm.graph.find_nodes(op="placeholder") if hasattr(node, "_dynamo_source")
    }
    try:
        yield
    finally:
        for node, source in saved.items():
            node._dynamo_source = source


def block_graph(
    gm: fx.GraphModule, nodes: list[fx.Node], name: str
) -> tuple[fx.GraphModule, tuple[fx.Node, ...], tuple[fx.Node, ...]]:
    """``nodes`` (a contiguous run of ``gm``, in graph order) as a graph of their own, ``gm``
    unchanged: the submodule (its outputs always a tuple), the values it takes (in the order of
    its placeholders) and the nodes of the run read after it (``torch.fx``'s fuser utilities)."""
    from torch.fx.passes.utils.fuser_utils import fuse_as_graphmodule

    sub, inputs, outputs = fuse_as_graphmodule(gm, nodes, name, dict.fromkeys(nodes), always_return_tuple=True)
    # Attributes the run reads (a higher-order op's body: checkpointing) come along.
    for node in sub.graph.find_nodes(op="get_attr"):
        target = str(node.target)
        if getattr(sub, target, None) is None and getattr(gm, target, None) is not None:
            setattr(sub, target, getattr(gm, target))
    return sub, inputs, outputs


def cut_out(gm: fx.GraphModule, nodes: list[fx.Node], name: str) -> tuple[fx.GraphModule, fx.Node]:
    """Move ``nodes`` into a submodule ``name`` of ``gm`` (:func:`block_graph`) and call it in their
    place, its outputs read with ``getitem``; returns the submodule and the call node."""
    from torch.fx.passes.utils.fuser_utils import erase_nodes, insert_subgm

    sub, inputs, outputs = block_graph(gm, nodes, name)
    insert_subgm(gm, sub, inputs, outputs)
    erase_nodes(gm, nodes)
    return sub, next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == name)


def fake_mode_of(example_inputs: Sequence[Any]) -> Any:
    return torch._guards.detect_fake_mode(example_inputs)


def is_fake(value: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(value, FakeTensor)
