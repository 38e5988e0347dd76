"""AOTAutograd and Inductor entry points for compiling one block of a graph on its own
(``compiler/blocks/``). Checked on torch 2.11.0, 2.13.0 and 2.15.0."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch._guards
import torch.fx as fx

from .capabilities import Capabilities


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
    decompositions = _decompositions(decompose)
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
    """``gm`` (an AOTAutograd forward or backward graph) compiled by Inductor, boxed (the input
    list is emptied); outputs keep ``gm``'s strides. With ``cpp_wrapper`` in ``config_patches``
    the C++ wrapper's settings are applied here, since ``compile_fx`` (which would on torch 2.11)
    is skipped. Checked on torch 2.11.0 and 2.13.0."""
    from torch._inductor.compile_fx import compile_fx_inner, get_cpp_wrapper_config

    # The calling graph was traced against these strides.
    out = next(iter(gm.graph.find_nodes(op="output")))
    out.meta["user_visible_output_idxs"] = [i for i, node in enumerate(out.args[0]) if isinstance(node, fx.Node)]
    cpp = bool(config_patches.get("cpp_wrapper"))
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch._guards.tracing(torch._guards.TracingContext(fake_mode)))
        stack.enter_context(torch._inductor.config.patch(config_patches))
        if cpp:  # read inside the patches above (a block's CUDA graphs off)
            stack.enter_context(torch._inductor.config.patch(get_cpp_wrapper_config()))
        kwargs = {"cpp_wrapper": True} if cpp else {}
        return _DirectAfterFirst(compile_fx_inner(gm, list(example_inputs), is_backward=backward, **kwargs))


class _DirectAfterFirst:
    """A compiled graph called through Inductor's wrapper once, then its generated ``call``.

    NOTE [a compiled block called directly]: a shared block's graphs run many times a step, so
    the host work of Inductor's per-call wrapper (recorder, autotune-cache and profiler checks,
    a metrics context) adds up. The first call goes through the wrapper (autotune-cache writes
    happen there), later ones skip it unless the profiler is on. ``current_callable`` (checked on
    torch 2.13.0) is read with ``getattr``: where missing, every call uses the wrapper.
    """

    __slots__ = ("compiled", "_direct")

    def __init__(self, compiled: Any) -> None:
        self.compiled = compiled
        self._direct: Callable[[list[Any]], Any] | None = None

    @property
    def generated(self) -> Callable[[list[Any]], Any] | None:
        """Inductor's generated ``call`` (``None`` where the compiled graph has none)."""
        return getattr(self.compiled, "current_callable", None)

    def __call__(self, inputs: list[Any]) -> Any:
        direct = self._direct
        if direct is not None and not torch.autograd.profiler._is_profiler_enabled:
            return direct(inputs)
        out = self.compiled(inputs)
        self._direct = self.generated
        return out


def start_compile_workers(backend: Capabilities, tensors: Iterable[Any]) -> bool:
    """Start Inductor's Triton compile workers now for an Inductor backend on CUDA tensors
    (NOTE [compile workers from the start]); whether it was asked to start.
    ``maybe_warm_pool``: checked on torch 2.11.0, 2.13.0 and 2.15.0."""
    if not backend.inductor or not any(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors):
        return False
    _warm_pool()
    return True


def _warm_pool() -> None:
    from torch._inductor.async_compile import maybe_warm_pool

    maybe_warm_pool()  # honours TORCH_WARM_POOL=0 and TORCHINDUCTOR_COMPILE_THREADS=1


def _decompositions(decompose: bool) -> dict[Any, Callable[..., Any]] | None:
    """Inductor's decomposition table where ``decompose`` (a graph Inductor compiles), else none."""
    if not decompose:
        return None
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def trace_into(
    graph: fx.Graph, fn: Callable[..., Any], args: Sequence[fx.Node], fake_mode: Any, *, decompose: bool
) -> fx.Node:
    """``fn(*args)`` traced to aten ops (``make_fx`` on the nodes' fake values) and copied into
    ``graph`` at its insertion point; returns the node of its one tensor result. ``decompose`` as
    ``graph`` was traced (:func:`partition`): Inductor lowers only decomposed ops (a compress
    hook's ``aten._to_copy`` has no lowering of its own)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    with fake_mode:
        traced = make_fx(fn, decomposition_table=_decompositions(decompose))(*[a.meta["val"] for a in args])
    val_map: dict[fx.Node, Any] = dict(zip(traced.graph.find_nodes(op="placeholder"), args))
    return graph.graph_copy(traced.graph, val_map)


def boxed(gm: fx.GraphModule) -> Callable[[list[Any]], Any]:
    """``gm`` run as it is (``aot_eager``), boxed like an Inductor-compiled graph."""

    def run(args: list[Any]) -> Any:
        values = list(args)
        args.clear()
        return gm(*values)

    return run


def node_flops(node: fx.Node) -> tuple[int, torch.dtype | None]:
    """The FLOPs of one aten op node (matmuls, convolutions, attention: ``FlopCounterMode``'s
    formulas, on the nodes' fake values; 0 for every other op) and the dtype of its first tensor
    input. ``torch.utils.flop_counter.flop_registry`` is keyed by op packet; checked on torch
    2.11.0 (device machines), 2.13.0 and 2.15.0 (CPU)."""
    from torch.utils.flop_counter import flop_registry

    formula = flop_registry.get(getattr(node.target, "overloadpacket", None))
    if formula is None:
        return 0, None
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    dtype = next((a.dtype for a in args if isinstance(a, torch.Tensor)), None)
    try:
        return int(formula(*args, **kwargs, out_val=node.meta.get("val"))), dtype
    except Exception:  # noqa: BLE001 - a formula that cannot read these arguments counts nothing
        return 0, dtype


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


def all_fake(tensors: Sequence[torch.Tensor]) -> bool:
    """Every one of ``tensors`` is a fake tensor, and no ``make_fx`` trace is under way: a run
    for the outputs' metadata (Dynamo's), not a trace (AOTAutograd's)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    return bool(tensors) and get_proxy_mode() is None and all(isinstance(t, FakeTensor) for t in tensors)


def op_trace_key(fn: Callable[[], Any], inputs: Sequence[torch.Tensor], *, extra: Any) -> tuple[Any, tuple]:
    """``fn()``'s result, and a key of what it computed on ``inputs``: the ATen ops dispatched
    (tensors numbered by first appearance, never by address), tensor layouts, and the autograd
    graph back to ``inputs``. Equal keys: the same function of the inputs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    numbers: dict[int, int] = {}
    alive: list[torch.Tensor] = []  # an id is only a tensor's while the tensor lives
    layouts: list[tuple] = []

    def number(t: torch.Tensor) -> int:
        n = numbers.get(id(t))
        if n is None:
            n = numbers[id(t)] = len(alive)
            alive.append(t)
            layouts.append((tuple(t.shape), tuple(t.stride()), t.storage_offset(), str(t.dtype), t.requires_grad))
        return n

    def key(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return ("t", number(value))
        if isinstance(value, (tuple, list)):
            return tuple(key(v) for v in value)
        if isinstance(value, dict):
            return tuple((k, key(v)) for k, v in value.items())
        if isinstance(value, (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format)):
            return repr(value)
        return type(value).__qualname__

    for t in inputs:
        number(t)
    rows: list[tuple] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            # Metadata queries are skipped: fake tensors cache them, so they vary between runs.
            if _has_tensor(out):
                rows.append((str(func), key(args), key(kwargs), key(out)))
            return out

    with Record():
        out = fn()
    return out, (tuple(rows), key(out), tuple(layouts), _autograd_key(out, inputs), extra)


def _has_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, (tuple, list)) and any(_has_tensor(v) for v in value)


def _autograd_key(out: Any, inputs: Sequence[torch.Tensor]) -> tuple:
    """The autograd graph from the tensors of ``out`` back to ``inputs``: each node's type and
    the nodes it feeds from, by order of appearance; ``inputs``' own nodes end the walk."""
    stops = {}
    for i, t in enumerate(inputs):
        node = t.grad_fn
        if node is not None:
            stops[node] = i
    flat: list[Any] = [out]
    roots = []
    while flat:
        v = flat.pop()
        if isinstance(v, torch.Tensor):
            roots.append(v.grad_fn)
        elif isinstance(v, (tuple, list)):
            flat.extend(reversed(v))
        elif isinstance(v, dict):
            flat.extend(reversed(list(v.values())))
    seen: dict[Any, int] = {}
    rows: list[tuple] = []
    queue = [r for r in roots if r is not None]
    while queue:
        node = queue.pop(0)
        if node in seen:
            continue
        seen[node] = len(seen)
        if node in stops:
            rows.append(("input", stops[node]))
            continue
        nexts = [n for n, _ in node.next_functions]
        rows.append((type(node).__name__, tuple(id(n) if n is not None else None for n in nexts)))
        queue.extend(n for n in nexts if n is not None)
    numbering = {id(n): i for n, i in seen.items()}
    return tuple(
        (name, tuple(numbering.get(x) if x is not None else None for x in rest)) if name != "input" else (name, rest)
        for name, rest in rows
    ), tuple(seen[r] if r is not None else None for r in roots)


def symbolic(t: torch.Tensor) -> bool:
    """``t`` has a symbolic size (Dynamo's dynamic shapes)."""
    return any(isinstance(d, torch.SymInt) for d in t.shape)
