"""Compile once per block: identical blocks of a whole graph share one compiled forward and backward.

A block is not shared, and compiles with the whole graph, when its graph differs from the others
(shapes, dtypes, constants, hooks), when shapes are dynamic, in a graph without gradients
(evaluation), when it draws random numbers (dropout in training), writes into an input, or sits
in an autocast or grad-mode region that starts outside it, and with a backend other than
Inductor or ``aot_eager``: the report says why (``shared_blocks``).

NOTE [one compile per block]: a model of N identical blocks gives Dynamo one graph in which the
block's computation appears N times, and AOTAutograd and Inductor trace, partition and compile
it N times: the first step grows with the model's depth. Compiling each block as a graph of its
own (torch's regional compilation) leaves the embeddings, head and loss uncompiled and DDP's
reducer around it, and torch's ``nested_compile_region`` gives wrong gradients for repeated
transformer blocks under Inductor (torch 2.13 and 2.15, CPU). So bucketwise keeps the whole graph
and makes each block one opaque operation in it, ``bucketwise::shared_block(key, inputs)``: the
first block's nodes are cut out (``partitioners/blocks.py``), split into a forward and a backward
and compiled once, and every identical block calls them with its own parameters and activations,
while the rest of the graph compiles as usual (bucket all-reduces, late waits, CUDA graphs over
the whole step). What the backward reads is returned once per distinct tensor; a view is rebuilt
at the start of the shared backward, where it is free, not as nodes around every block.

NOTE [a bucket per block]: under ``fused`` the graph around the blocks would carry, for every
parameter of every block, the ``BucketSync`` view, its recomputation in the backward, the flatten
and scale onto the wire and the views of the reduced gradient: most of what AOTAutograd and
Inductor would still trace per block. Instead each shared block reduces its own parameters (those
read inside it only) as one bucket: its compiled backward returns their gradients last as one
flat buffer already on the wire (``CommSpec.to_wire``, ``BucketSync``'s rule, so compiled once
with the block), and the operation's autograd formula all-reduces it as soon as the block's
backward is done (its wait late, NOTE [late waits]) and hands back views of it. The other
parameters' buckets are planned around them; the report lists one bucket per block. Every
parameter keeps its ``BucketSync`` instead under a comm hook reduced by a hook program (PowerSGD,
a traceable user hook), when a block's parameters differ in dtype without a compress hook, or
when the same block takes parameters at other inputs elsewhere in the graph.

NOTE [computed once before the blocks]: what a block computes from values every block reads the
same (HF Llama's attention mask made an additive bias) the whole graph computes once, AOTAutograd's
CSE merging the blocks' copies, while a shared block would compute it at every call and keep it
for its backward, once per block. So the part of the shared forward that reads only such inputs
(the same node at that input of every block, no gradient) and constants moves into the graph
around the blocks, before the first, and what it computes becomes the last inputs of every
block's call. Only ops that autocast leaves alone move (comparisons, selection, casts, element-wise
arithmetic without a precision rule, shape ops), since the graph around the blocks is traced again
under the step's autocast mode; views stay in the block, where they are free. An input the forward
no longer reads, without a gradient, is not passed at all (``bg.drop_unread``): Inductor copies a
view given to an operator at every call. The report lists what moved (``computed_before_blocks``).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import sys
import time
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from .._compat import aot, ops
from .._compat import dynamo as dc
from .._compat.capabilities import Capabilities
from ..distributed.fused import block_wire
from ..distributed.fused.block_wire import BlockWire
from ..distributed.fused.cache_keys import source_key
from ..distributed.fused.sync import REDUCED_PARAMS_META, CommSpec
from ..distributed.result import CompileOutcome
from ..partitioners import block_graphs as bg
from ..partitioners.block_graphs import BlockLayout, MovedOut
from ..partitioners.blocks import find_block_run, piece_signature
from . import block_calls, block_cost

log = logging.getLogger(__name__)

_RANDOM = ("rand", "dropout", "bernoulli", "philox", "seed", "normal_", "uniform_", "exponential_", "multinomial")


# NOTE [an int key, not the block]: the operation takes an int that names its block here, not
# the block itself. torch's opaque reference types (``torch._library.opaque_object``, private)
# would let it take the SharedBlock, but the FX-graph and AOTAutograd caches pickle the object
# into their keys, so a block holding compiled callables makes both bypass (the compile time
# sharing exists to save) unless the class pickles as its layout alone; Dynamo guards the object
# by type only, so blocks of two layouts would share a graph unless a guard_fn returns the
# layout; while AOTAutograd traces, the autograd formula sees a fake that exposes only the
# attributes registered as members; and the registration API differs between torch 2.11 and
# 2.13 (a required base class, member and guard hooks). The weak dictionary drops a block with
# the graph backend that keeps it (``Sharing.kept``); keys are never reused within a process.
_BLOCKS: weakref.WeakValueDictionary[int, SharedBlock] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


# NOTE [a shared block in stages]: what is known of a shared block grows in stages, each a
# record made once by the step that finds it. ``partitioners/block_graphs.py`` takes what every
# block computes the same out of the forward (``move_out``: ``MovedOut``), drops the inputs the
# forward reads no more (``drop_unread``: ``SharedBlock.reads``) and lays out what the forward
# hands the backward (``plan_layout``: ``BlockLayout``); under ``fused``,
# ``distributed/fused/block_wire.py`` makes the backward return the block's own parameters'
# gradients as one flat buffer (``grads_onto_wire``: ``BlockWire``, with the gradients' new
# layout); ``_compile`` compiles both graphs and assembles the ``SharedBlock``. Only what
# the first call finds (``FirstCall``) changes afterwards, once.


@dataclasses.dataclass
class FirstCall:
    """What a shared block's first call finds, looked at once and then reused (host time per call)."""

    aliased: frozenset[int] | None = None
    """The outputs copied at every call (``copied``, and any found sharing memory with an input
    or an earlier output at the first call); ``None`` before it."""
    restride: tuple[int, ...] | None = None
    """The backward's inputs whose layout is looked at every call (the gradients, and any saved
    tensor laid out otherwise at the first call); ``None`` before it."""


@dataclasses.dataclass(frozen=True, eq=False)
class SharedBlock:
    """One block's compiled forward and backward, called by every block identical to it (NOTE
    [a shared block in stages])."""

    key: int
    layout: BlockLayout
    forward: Callable[[list[Any]], Any]
    """Boxed: ``forward([inputs])`` -> the block's outputs, then the bases the backward reads."""
    backward: Callable[[list[Any]], Any]
    """Boxed: ``backward([saved..., grads of the outputs])`` -> what ``layout.grads`` says."""
    wire: BlockWire | None = None
    moved: MovedOut | None = None
    reads: tuple[int, ...] | None = None
    """The positions, among a call's inputs (the block's own, then what ``moved`` computed), of
    those the compiled forward takes (``bg.drop_unread``); ``None``: all of them."""
    cost: block_cost.BlockCost | None = None
    """Its call's estimated cost, where ``share_blocks="auto"`` decides by it (NOTE [sharing by cost])."""
    first_call: FirstCall = dataclasses.field(default_factory=FirstCall)


@dataclasses.dataclass(frozen=True)
class BlockBuckets:
    """``fused``: the DDP parameters whose gradients a shared block may reduce itself, and how
    (NOTE [a bucket per block])."""

    spec: CommSpec
    params: frozenset[fx.Node]
    """Placeholders of dense DDP parameters that need a gradient, each the only placeholder of
    its tensor."""


def _shared_block(key: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    block = _BLOCKS[key]
    seen = block.first_call
    if seen.aliased is None:
        _check_layouts("shared_block", inputs, block.layout.forward_layouts)
    out = list(block.forward(list(inputs)))
    if seen.aliased is None:
        # Which outputs share memory is the compiled graph's structure, the same at every call:
        # found once (the plan avoids it; a view op torch does not mark as one could still do
        # it), then copied at every call without looking again (host time per block call).
        seen.aliased = block.layout.copied | _aliasing(out, inputs)
    for i in seen.aliased:
        out[i] = out[i].clone()
    return out


def _check_layouts(op: str, given: Sequence[torch.Tensor], expected: Sequence[tuple]) -> None:
    """At a block's first call: its inputs have the shapes and strides its graph was compiled
    for (Inductor's own per-call checks are off for shared blocks; ``needs_exact_strides``
    keeps them so)."""
    for i, (t, (shape, stride)) in enumerate(zip(given, expected)):
        # A dimension of size 1 may have any stride.
        if tuple(t.shape) != shape or any(n > 1 and a != b for n, a, b in zip(shape, t.stride(), stride)):
            raise AssertionError(
                f"bucketwise::{op}: expected input {i} of shape {shape} and strides {stride}, "
                f"got {tuple(t.shape)} and {tuple(t.stride())}"
            )


def _aliasing(out: list[torch.Tensor], inputs: list[torch.Tensor]) -> frozenset[int]:
    """The outputs that share memory with an input or an earlier output."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if t.numel()}
    found = set()
    for i, t in enumerate(out):
        if not t.numel():
            continue
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            found.add(i)
        seen.add(ptr)
    return frozenset(found)


def _shared_block_fake(key: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [
        torch.empty_strided(shape, stride, dtype=dtype, device=device)
        for shape, stride, dtype, device in _BLOCKS[key].layout.outputs
    ]


def _shared_block_backward(key: int, saved_and_grads: list[torch.Tensor]) -> list[torch.Tensor]:
    block = _BLOCKS[key]
    layout, seen = block.layout, block.first_call
    # The layout the backward was compiled for: a tensor laid out otherwise (a gradient autograd
    # made as zeros with its output's strides; AOTAutograd's own runtime makes those contiguous)
    # is copied into it. The saved tensors come from compiled graphs, laid out the same at every
    # call: looked at once, then only the gradients are (host time per block call).
    if seen.restride is None:
        n_saved = len(saved_and_grads) - layout.n_tangents
        seen.restride = tuple(
            i
            for i, (t, stride) in enumerate(zip(saved_and_grads, layout.input_strides))
            if i >= n_saved or t.stride() != stride
        )
    inputs = list(saved_and_grads)
    strides = layout.input_strides
    for i in seen.restride:
        if inputs[i].stride() != strides[i]:
            inputs[i] = _laid_out(inputs[i], strides[i])
    grads = block.backward(inputs)
    # Only the gradients there are: a placeholder for a missing one would be a tensor made on
    # the host, which no CUDA graph of the compiled backward around this call can capture.
    return [grads[i] for i in layout.present]


def _shared_block_backward_fake(key: int, saved_and_grads: list[torch.Tensor]) -> list[torch.Tensor]:
    grads = _BLOCKS[key].layout.grads
    return [torch.empty_strided(m[0], m[1], dtype=m[2], device=m[3]) for m in grads if m is not None]


def _setup_context(ctx: Any, inputs: tuple[int, list[torch.Tensor]], output: list[torch.Tensor]) -> None:
    key, ins = inputs
    block = _BLOCKS[key]
    ctx.key = key
    pools = {"input": ins, "output": output, "base": output[block.layout.n_user :]}
    # Held by the context, not ``save_for_backward``: the formula runs only while AOTAutograd
    # traces the joint graph (the compiled forward calls the operator without a gradient), where
    # a saved tensor would be a ``detach`` in the forward graph and another in the backward for
    # each tensor the backward reads (28 nodes per block of HF Llama), traced, partitioned and
    # lowered once per block for nothing.
    ctx.saved = [pools[kind][i] for kind, i in block.layout.roots]


def _backward(ctx: Any, grads: Sequence[torch.Tensor | None]) -> tuple[None, list[torch.Tensor | None]]:
    block = _BLOCKS[ctx.key]
    layout = block.layout
    tangents = []
    for j in range(layout.n_user):
        shape, _, dtype, device = layout.outputs[j]
        if dtype.is_floating_point:
            tangents.append(grads[j] if grads[j] is not None else torch.zeros(shape, dtype=dtype, device=device))
    present = iter(SHARED_BLOCK_BACKWARD(ctx.key, [*ctx.saved, *tangents]))
    grads = [None if meta is None else next(present) for meta in layout.grads]
    return None, block_wire.reduced_grads(block.wire, grads) if block.wire is not None else grads


def _laid_out(t: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    return torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device).copy_(t)


class _SharedBlockFormula(torch.autograd.Function):
    """The autograd formula of ``bucketwise::shared_block``, used while AOTAutograd traces the
    joint graph: the shared backward on what the shared forward returned for it."""

    @staticmethod
    def forward(ctx: Any, key: int, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ins = list(inputs)
        out = SHARED_BLOCK(key, ins)
        _setup_context(ctx, (key, ins), out)
        return tuple(out)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        _, input_grads = _backward(ctx, grads)
        return (None, *input_grads)


# Registered with one Python call per call at run time (NOTE [one Python call per op]).
SHARED_BLOCK = ops.define(
    "bucketwise::shared_block",
    "(int key, Tensor[] inputs) -> Tensor[]",
    kernel=_shared_block,
    fake=_shared_block_fake,
    formula=_SharedBlockFormula,
    tags=(torch.Tag.needs_exact_strides,),
)
SHARED_BLOCK_BACKWARD = ops.define(
    "bucketwise::shared_block_backward",
    "(int key, Tensor[] saved_and_grads) -> Tensor[]",
    kernel=_shared_block_backward,
    fake=_shared_block_backward_fake,
    tags=(torch.Tag.needs_exact_strides,),
)


def cache_targets() -> dict[str, str]:
    """What a graph calling ``bucketwise::shared_block`` must be cache-keyed by (NOTE [compile cache
    keys]): the graph's compiled backward calls ``shared_block_backward`` with what this module's
    autograd formula hands it (the roots of the saved tensors, in the order ``plan_layout`` chose;
    under ``fused`` the flat buffer ``grads_onto_wire`` made, reduced by ``reduced_grads``), which
    AOTAutograd's and Inductor's caches do not see. Keyed by the source of the three modules that
    decide it, a cached graph from another version of them is not loaded."""
    return {f"{__name__}.shared_block": source_key(sys.modules[__name__], bg, block_wire)}


@dataclasses.dataclass
class Sharing:
    """What :func:`share_blocks` did to one graph, for the report."""

    blocks: str
    """The module list (``model.layers``)."""
    block_class: str
    count: int
    """Blocks that call a shared compile (the repeated ones)."""
    compiles: int
    """Distinct blocks compiled (one where every block is the same computation)."""
    outcomes: list[CompileOutcome]
    kept: list[SharedBlock] = dataclasses.field(default_factory=list, repr=False)
    """The compiled blocks, alive as long as the graph's backend."""
    bucket_per_block: bool | str | None = None
    """``fused``: ``True`` where every shared block reduces its parameters' gradients itself (a
    bucket per block), else why not; ``None`` under other strategies."""
    dynamo: bool | str | None = None
    """``True`` where Dynamo met each block as one call (NOTE [Dynamo calls a block]), else why
    it traced every block."""
    cpp_wrapper: bool = False
    """Compiled in Inductor's C++ wrapper, as the graph around them."""

    @property
    def computed_before_blocks(self) -> list[str]:
        """The ops moved out of the blocks (NOTE [computed once before the blocks])."""
        return sorted(
            {
                bg.op_name(n)
                for block in self.kept
                if block.moved is not None
                for n in block.moved.before.graph.nodes
                if n.op == "call_function"
            }
        )

    @property
    def compile_seconds(self) -> float:
        return sum(o.seconds for o in self.outcomes)

    def to_dict(self) -> dict[str, Any]:
        per = self.compile_seconds / self.compiles if self.compiles else 0.0
        return {
            "blocks": self.blocks,
            "class": self.block_class,
            "count": self.count,
            "compiles": self.compiles,
            "compile_seconds": round(self.compile_seconds, 6),
            "saved_seconds": round(per * (self.count - self.compiles), 6),
            **({} if self.bucket_per_block is None else {"bucket_per_block": self.bucket_per_block}),
            **({} if self.dynamo is None else {"dynamo_calls": self.dynamo}),
            **({"computed_before_blocks": moved} if (moved := self.computed_before_blocks) else {}),
            **({"cost": costs} if (costs := [b.cost.to_dict() for b in self.kept if b.cost]) else {}),
            **({"cpp_wrapper": True} if self.cpp_wrapper else {}),
        }


def share_blocks(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    backend: Capabilities,
    config_patches: dict,
    buckets: BlockBuckets | None = None,
    cost: block_cost.CostRule | None = None,
) -> tuple[Sharing | None, str | None]:
    """Rewrite ``gm`` in place so that its identical blocks call one compiled block; returns what
    was shared, or ``None`` and why nothing was (NOTE [one compile per block]). ``buckets``
    (``fused``): the parameters a shared block may reduce itself (NOTE [a bucket per block]);
    ``cost``: share only where the blocks' estimated cost says so (NOTE [sharing by cost])."""
    if any(isinstance(a, torch.SymInt) or (isinstance(a, torch.Tensor) and bg.is_symbolic(a)) for a in example_inputs):
        return None, "dynamic shapes"
    if not torch.is_grad_enabled() or not any(isinstance(a, torch.Tensor) and a.requires_grad for a in example_inputs):
        return None, "no gradients in this graph (evaluation, no_grad): blocks share a compile in training graphs"
    run, why = find_block_run(gm)
    if run is None:
        return None, why
    why = bg.mode_switch_across(gm, run)
    if why is not None:
        return None, why
    fake_mode = aot.fake_mode_of(example_inputs)
    values = bg.fake_values(gm, example_inputs, fake_mode)
    parts = bg.block_parts(gm, run)
    # Every repeated block is compiled, or found the same as one compiled, before the graph
    # changes: a block that cannot be shared leaves the graph as Dynamo gave it. A block that
    # is the only one of its kind stays in the graph.
    graphs = [aot.block_graph(gm, part, f"block_{k}") for k, part in enumerate(parts)]
    signatures = [
        piece_signature(sub, [values[n] for n in inputs], opaque=_block_call_key) for sub, inputs, _ in graphs
    ]
    repeated = {sig for sig in signatures if signatures.count(sig) > 1}
    if not repeated:
        return None, f"no two blocks of {run.name} are the same computation (shapes, dtypes or constants differ)"
    reduced, per_block = _reduced_inputs(graphs, parts, signatures, repeated, values, buckets)
    invariant = bg.invariant_inputs(graphs, signatures, repeated, values)
    blocks: dict[tuple, SharedBlock] = {}
    outcomes: list[CompileOutcome] = []
    for k, ((sub, inputs, _), signature) in enumerate(zip(graphs, signatures)):
        if signature in repeated and signature not in blocks:
            try:
                blocks[signature], outcome = _compile(
                    sub,
                    [values[n] for n in inputs],
                    fake_mode,
                    backend,
                    config_patches,
                    reduced=reduced.get(signature, ()),
                    spec=buckets.spec if buckets is not None else None,
                    invariant=invariant[signature],
                    cost=cost,
                )
            except bg.NotShareable as exc:
                return None, f"{run.name}.{k}: {exc}"
            except block_cost.KeptWhole as exc:
                cost.refused(run.name, sum(sig in repeated for sig in signatures), str(exc))
                return None, str(exc)
            outcomes.append(outcome)
    shared = [(part, blocks[sig]) for part, sig in zip(parts, signatures) if sig in blocks]
    computed: dict[int, list[fx.Node]] = {}  # block key -> what ``block.moved.before`` computed
    with aot.dynamo_sources_kept(gm):
        for k, (part, block) in enumerate(shared):
            _, call = aot.cut_out(gm, part, f"block_{k}")
            inputs = list(call.args)
            with gm.graph.inserting_before(call):
                if block.moved is not None:
                    # Before the first block of its kind, which every other one follows.
                    if block.key not in computed:
                        moved = block.moved
                        computed[block.key] = bg.insert_graph(
                            gm.graph, moved.before, [inputs[i] for i in moved.invariant]
                        )
                    inputs += computed[block.key]
                if block.reads is not None:
                    inputs = [inputs[i] for i in block.reads]
                op = gm.graph.call_function(SHARED_BLOCK, (block.key, inputs))
            if block.wire is not None:
                op.meta[REDUCED_PARAMS_META] = [inputs[i] for i in block.wire.reduced]
            call.replace_all_uses_with(op)
            gm.graph.erase_node(call)
            gm.delete_submodule(str(call.target))
        gm.graph.lint()
        gm.recompile()
    kept = list(blocks.values())
    sharing = Sharing(
        run.name, run.block_class, len(shared), len(kept), outcomes, kept, per_block, cpp_wrapper=backend.cpp_wrapper
    )
    return sharing, None


def _block_call_key(node: fx.Node) -> tuple[Any, Any] | None:
    """A block Dynamo called as one op (NOTE [Dynamo calls a block]) computes what its recorded
    run did; its first argument (which block) takes no part."""
    if not block_calls.is_block_call(node):
        return None
    computation = block_calls.fingerprint(node)
    return (computation if computation is not None else ("unrecorded", node.args[0])), node.args[1:]


def _reduced_inputs(
    graphs: list[tuple[fx.GraphModule, tuple[fx.Node, ...], tuple[fx.Node, ...]]],
    parts: list[list[fx.Node]],
    signatures: list[tuple],
    repeated: set[tuple],
    values: dict[fx.Node, Any],
    buckets: BlockBuckets | None,
) -> tuple[dict[tuple, tuple[int, ...]], bool | str | None]:
    """Per repeated signature, the inputs whose gradients its compiled block reduces (NOTE [a
    bucket per block]); and ``True``, or why no block does (``None`` without ``buckets``)."""
    if buckets is None:
        return {}, None
    reduced: dict[tuple, tuple[int, ...]] = {}
    for (_, inputs, _), part, signature in zip(graphs, parts, signatures):
        if signature not in repeated:
            continue
        inside = set(part)
        # A parameter read only inside this block: its gradient is complete when the block's
        # backward is done.
        positions = tuple(
            i for i, node in enumerate(inputs) if node in buckets.params and all(user in inside for user in node.users)
        )
        if reduced.setdefault(signature, positions) != positions:
            return {}, "the same block reads DDP parameters at other inputs in another place of the graph"
    dtypes = {
        values[inputs[i]].dtype
        for (_, inputs, _), signature in zip(graphs, signatures)
        for i in reduced.get(signature, ())
    }
    if len(dtypes) > 1 and buckets.spec.comm_dtype is None:
        return {}, f"the blocks' parameters have several dtypes ({sorted(map(str, dtypes))})"
    if not any(reduced.values()):
        return {}, "no DDP parameter is read only inside one block"
    return reduced, True


def _compile(
    sub: fx.GraphModule,
    fakes: list[Any],
    fake_mode: Any,
    backend: Capabilities,
    config_patches: dict,
    *,
    reduced: tuple[int, ...] = (),
    spec: CommSpec | None = None,
    invariant: tuple[int, ...] = (),
    cost: block_cost.CostRule | None = None,
) -> tuple[SharedBlock, CompileOutcome]:
    phases0, counts0 = dc.compile_phase_seconds(), dc.compile_counters()
    start = time.perf_counter()
    try:
        fw, bw = aot.partition(sub, fakes, fake_mode, decompose=backend.inductor)
    except Exception as exc:  # noqa: BLE001 - any failure: the block compiles with the whole graph
        raise bg.NotShareable(
            f"AOTAutograd could not split the block on its own: {type(exc).__name__}: {exc}"[:300]
        ) from exc
    random = [
        str(n.target) for n in fw.graph.nodes if n.op == "call_function" and any(r in str(n.target) for r in _RANDOM)
    ]
    if random:
        raise bg.NotShareable(f"the block draws random numbers ({random[0]})")
    if any(n.op == "call_function" and dc.written_args(n) for n in fw.graph.nodes):
        raise bg.NotShareable("the block writes into one of its inputs")
    estimated = cost.check(fw, bw) if cost is not None else None  # before anything is compiled
    # The stages of NOTE [a shared block in stages], in order: each rewrites fw and bw in place.
    moved = bg.move_out(fw, bw, invariant, n_user=len(bg.user_outputs(sub)))
    reads = bg.drop_unread(fw, bw)
    layout = bg.plan_layout(sub, fw, bw, fake_mode)
    wire = None
    if reduced:
        if spec is None:
            raise AssertionError(f"expected a comm spec for the reduced inputs {reduced}, got None")
        # A reduced parameter has a gradient, so the forward still takes it: its position there.
        at = tuple(i if reads is None else reads.index(i) for i in reduced)
        wire, grads = block_wire.grads_onto_wire(
            bw, [fakes[i] for i in reduced], at, spec, fake_mode, decompose=backend.inductor
        )
        layout = dataclasses.replace(layout, grads=grads)
    if backend.inductor:
        fw_inputs = [n.meta["val"] for n in fw.graph.find_nodes(op="placeholder")]
        bw_inputs = [n.meta["val"] for n in bw.graph.find_nodes(op="placeholder")]
        forward = aot.inductor_compile(fw, fw_inputs, fake_mode, backward=False, config_patches=config_patches)
        backward = aot.inductor_compile(bw, bw_inputs, fake_mode, backward=True, config_patches=config_patches)
    else:
        forward, backward = aot.boxed(fw), aot.boxed(bw)
    block = SharedBlock(next(_KEYS), layout, forward, backward, wire=wire, moved=moved, reads=reads, cost=estimated)
    _BLOCKS[block.key] = block
    outcome = CompileOutcome(backend=backend.name, seconds=time.perf_counter() - start)
    phases1 = dc.compile_phase_seconds()
    outcome.phases = {k: round(v - phases0.get(k, 0.0), 6) for k, v in phases1.items() if v - phases0.get(k, 0.0) > 0}
    outcome.counts = {k: v - counts0[k] for k, v in dc.compile_counters().items() if v > counts0[k]}
    return block, outcome
