"""Identical blocks of a whole graph share one compiled forward and backward; a block that cannot
be shared compiles with the whole graph, and the report says why.

NOTE [one compile per block]: AOTAutograd and Inductor compile each of N identical blocks: the
first step grows with depth. Regional compilation leaves the embeddings, head, loss and DDP's
reducer uncompiled, and ``nested_compile_region`` gives wrong gradients for repeated transformer
blocks under Inductor (torch 2.13, 2.15, CPU). So the graph stays whole and each block becomes one
opaque op, ``bucketwise::shared_block(key, inputs)``, running the first block's compiled forward
and backward; its backward takes each distinct tensor once, rebuilding the views.

NOTE [a bucket per block]: under ``fused`` the graph would carry each parameter's ``BucketSync``
views, flatten and scale: most of what is traced per block. Instead a shared block's backward
returns the gradients of the parameters read only inside it last, as one flat ``CommSpec.to_wire``
buffer the op's autograd formula all-reduces (its wait late, NOTE [late waits]) and hands back as
views. Not with a hook program, nor where ``find.reduced_inputs`` says why not.

NOTE [computed once before the blocks]: what every block computes the same (HF Llama's mask made a
bias) the whole graph computes once (CSE), a shared block at every call, kept for its backward. So
that part of the forward (from the same gradient-free node at that input of every block, and
constants) moves before the first block, its results the last inputs of every call. Only ops
autocast leaves alone move (the graph around is traced again under autocast); views stay: free.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import time
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from ..._compat import aot, ops
from ..._compat import collectives as cc
from ..._compat import dynamo as dc
from ..._compat.capabilities import Capabilities
from ...distributed.fused.cache_keys import source_key
from ...distributed.fused.sync import REDUCED_PARAMS_META, CommSpec
from ...distributed.result import CompileOutcome
from . import find, graphs

_RANDOM = ("rand", "dropout", "bernoulli", "philox", "seed", "normal_", "uniform_", "exponential_", "multinomial")

# NOTE [an int key, not the block]: as torch's opaque reference type, a block would be pickled into
# the FX-graph and AOTAutograd cache keys (bypassing both), guarded by type only, faked with only
# registered members, and its API differs between torch 2.11 and 2.13. A block lives as long as
# the graph backend keeping it (``Sharing.kept``); keys are never reused within a process.
_BLOCKS: weakref.WeakValueDictionary[int, SharedBlock] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


# NOTE [a shared block in stages]: each step in ``graphs.py`` makes one record once: ``moved``,
# ``reads``, under ``fused`` ``BlockWire``, then ``BlockLayout``; ``_compile`` assembles them. Only
# what the first call finds (``aliased``, ``restride``) changes after.
@dataclasses.dataclass(eq=False)
class SharedBlock:
    """One block's compiled (boxed) forward and backward, called by every block identical to it.
    ``moved`` computes from the call's inputs at ``invariant`` what every call takes last; ``reads``:
    the inputs the forward takes (``None``: all); ``aliased``, ``restride``: found by the first call."""

    key: int
    layout: graphs.BlockLayout
    forward: Callable[[list[Any]], Any]
    backward: Callable[[list[Any]], Any]
    wire: graphs.BlockWire | None = None
    moved: fx.GraphModule | None = None
    invariant: tuple[int, ...] = ()
    reads: tuple[int, ...] | None = None
    cost: find.BlockCost | None = None
    aliased: frozenset[int] | None = None
    restride: tuple[int, ...] | None = None


def _shared_block(key: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    block = _BLOCKS[key]
    if block.aliased is None:
        # Inductor's own per-call checks are off for shared blocks: the first call checks layouts.
        for i, (t, (shape, stride)) in enumerate(zip(inputs, block.layout.forward_layouts)):
            if tuple(t.shape) != shape or any(n > 1 and a != b for n, a, b in zip(shape, t.stride(), stride)):
                raise AssertionError(
                    f"bucketwise::shared_block: expected input {i} of shape {shape} and strides {stride}, "
                    f"got {tuple(t.shape)} and {tuple(t.stride())}"
                )
    out = list(block.forward(list(inputs)))
    if block.aliased is None:
        # Which outputs share memory is the compiled graph's structure: found once, then copied.
        ptrs = {t.untyped_storage().data_ptr() for t in inputs if t.numel()}
        aliased = set(block.layout.copied)
        for i, t in enumerate(out):
            if t.numel():
                ptr = t.untyped_storage().data_ptr()
                if ptr in ptrs:
                    aliased.add(i)
                ptrs.add(ptr)
        block.aliased = frozenset(aliased)
    for i in block.aliased:
        out[i] = out[i].clone()
    return out


def _shared_block_backward(key: int, saved_and_grads: list[torch.Tensor]) -> list[torch.Tensor]:
    block = _BLOCKS[key]
    layout = block.layout
    # Inputs not laid out as compiled for are copied; saved tensors are checked once, gradients always.
    strides = layout.input_strides
    if block.restride is None:
        n_saved = len(layout.roots)
        block.restride = tuple(i for i, t in enumerate(saved_and_grads) if i >= n_saved or t.stride() != strides[i])
    inputs = list(saved_and_grads)
    for i in block.restride:
        if (t := inputs[i]).stride() != strides[i]:
            inputs[i] = torch.empty_strided(t.shape, strides[i], dtype=t.dtype, device=t.device).copy_(t)
    grads = block.backward(inputs)
    # Only the gradients there are: a missing one's placeholder, made on the host, no CUDA graph captures.
    return [grads[i] for i in layout.present]


class _SharedBlockFormula(torch.autograd.Function):
    """The autograd formula of ``bucketwise::shared_block``, used while AOTAutograd traces."""

    @staticmethod
    def forward(ctx: Any, key: int, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = SHARED_BLOCK(key, list(inputs))
        ctx.key = key
        pools = {"input": inputs, "output": out, "base": out[_BLOCKS[key].layout.n_user :]}
        # Not ``save_for_backward``: each saved tensor would be a ``detach`` in each traced graph.
        ctx.saved = [pools[kind][i] for kind, i in _BLOCKS[key].layout.roots]
        return tuple(out)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        block = _BLOCKS[ctx.key]
        layout = block.layout
        tangents = [
            grads[j] if grads[j] is not None else torch.zeros(shape, dtype=dtype, device=device)
            for j, (shape, _, dtype, device) in enumerate(layout.outputs[: layout.n_user])
            if dtype.is_floating_point
        ]
        present = iter(SHARED_BLOCK_BACKWARD(ctx.key, [*ctx.saved, *tangents]))
        grads = [None if meta is None else next(present) for meta in layout.grads]
        return (None, *(graphs.reduced_grads(block.wire, grads) if block.wire is not None else grads))


def _empty(metas: tuple[graphs.TensorMeta | None, ...]) -> list[torch.Tensor]:
    return [torch.empty_strided(*m[:2], dtype=m[2], device=m[3]) for m in metas if m]


# Registered with one Python call per call at run time (NOTE [one Python call per op]).
_EXACT = (torch.Tag.needs_exact_strides,)
SHARED_BLOCK = ops.define(
    "bucketwise::shared_block",
    "(int key, Tensor[] inputs) -> Tensor[]",
    kernel=_shared_block,
    fake=lambda key, _: _empty(_BLOCKS[key].layout.outputs),
    formula=_SharedBlockFormula,
    tags=_EXACT,
)
SHARED_BLOCK_BACKWARD = ops.define(
    "bucketwise::shared_block_backward",
    "(int key, Tensor[] saved_and_grads) -> Tensor[]",
    kernel=_shared_block_backward,
    fake=lambda key, _: _empty(_BLOCKS[key].layout.grads),
    tags=_EXACT,
)


def cache_targets() -> dict[str, str]:
    """Cache keys (NOTE [compile cache keys]) for the layout ``graphs.py`` makes, unseen by torch's caches."""
    return {f"{__name__}.shared_block": source_key(sys.modules[__name__], graphs)}


@dataclasses.dataclass
class Sharing:
    """What :func:`share_blocks` did to one graph, for the report; ``kept``: the distinct blocks
    compiled, alive as long as the graph's backend; ``bucket_per_block``/``dynamo``: ``True`` or why not."""

    run: find.BlockRun
    count: int
    outcomes: list[CompileOutcome]
    kept: list[SharedBlock] = dataclasses.field(repr=False)
    bucket_per_block: bool | str | None = None
    dynamo: bool | str | None = None
    cpp_wrapper: bool = False

    def to_dict(self) -> dict[str, Any]:
        seconds = sum(o.seconds for o in self.outcomes)
        compiles = len(self.kept)
        # The ops moved out of the blocks (NOTE [computed once before the blocks]).
        nodes = [n for b in self.kept if b.moved is not None for n in b.moved.graph.nodes]
        moved = sorted({cc.op_name(n) for n in nodes if n.op == "call_function"})
        costs = [b.cost.to_dict() for b in self.kept if b.cost]
        return {
            "blocks": self.run.name,
            "class": self.run.block_class,
            "count": self.count,
            "compiles": compiles,
            "compile_seconds": round(seconds, 6),
            "saved_seconds": round(seconds / compiles * (self.count - compiles), 6) if compiles else 0.0,
            **({} if self.bucket_per_block is None else {"bucket_per_block": self.bucket_per_block}),
            **({} if self.dynamo is None else {"dynamo_calls": self.dynamo}),
            **({"computed_before_blocks": moved} if moved else {}),
            **({"cost": costs} if costs else {}),
            **({"cpp_wrapper": True} if self.cpp_wrapper else {}),
        }


def share_blocks(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    backend: Capabilities,
    config_patches: dict,
    buckets: find.BlockBuckets | None = None,
    cost: find.DeviceCost | None = None,
) -> tuple[Sharing | None, str | None]:
    """``gm``'s identical blocks call one compiled block (NOTE [one compile per block]), rewritten in
    place, where ``cost`` allows (NOTE [sharing by cost]); what was shared, or ``None`` and why not."""
    if any(isinstance(a, torch.SymInt) or (isinstance(a, torch.Tensor) and aot.symbolic(a)) for a in example_inputs):
        return None, "dynamic shapes"
    if not torch.is_grad_enabled() or not any(isinstance(a, torch.Tensor) and a.requires_grad for a in example_inputs):
        return None, "no gradients in this graph (evaluation, no_grad): blocks share a compile in training graphs"
    run, why = find.find_block_run(gm)
    if run is None or (why := find.mode_switch_across(gm, run)) is not None:
        return None, why
    fake_mode = aot.fake_mode_of(example_inputs)
    values = find.fake_values(gm, example_inputs, fake_mode)
    parts = find.block_parts(gm, run)
    # Every block is compiled before the graph changes: one that cannot be shared leaves it whole.
    subs = [aot.block_graph(gm, part, f"block_{k}") for k, part in enumerate(parts)]
    signatures = [find.piece_signature(sub, [values[n] for n in ins]) for sub, ins, _ in subs]
    repeated = [(s, ins, part) for s, (_, ins, _), part in zip(signatures, subs, parts) if signatures.count(s) > 1]
    if not repeated:
        return None, f"no two blocks of {run.name} are the same computation (shapes, dtypes or constants differ)"
    reduced, per_block = find.reduced_inputs(repeated, values, buckets)
    blocks: dict[tuple, SharedBlock] = {}
    outcomes: list[CompileOutcome] = []
    spec = buckets.spec if buckets is not None else None
    for k, ((sub, ins, _), sig) in enumerate(zip(subs, signatures)):
        if signatures.count(sig) > 1 and sig not in blocks:
            fakes = [values[n] for n in ins]
            invariant = find.invariant_inputs([i for s, i, _ in repeated if s == sig], values)
            try:
                blocks[sig], outcome = _compile(
                    sub, fakes, fake_mode, backend, config_patches, reduced.get(sig, ()), spec, invariant, cost
                )
            except graphs.NotShareable as exc:
                return None, f"{run.name}.{k}: {exc}"
            except find.KeptWhole as exc:
                exc.container, exc.count = run.name, len(repeated)
                raise
            outcomes.append(outcome)
    shared = [(part, blocks[s]) for s, _, part in repeated]
    computed: dict[int, list[fx.Node]] = {}  # block key -> what ``block.moved`` computed
    with aot.dynamo_sources_kept(gm):
        for k, (part, block) in enumerate(shared):
            _, call = aot.cut_out(gm, part, f"block_{k}")
            args = list(call.args)
            with gm.graph.inserting_before(call):
                if block.moved is not None:
                    if block.key not in computed:  # before the first block of its kind
                        given = [args[i] for i in block.invariant]
                        computed[block.key] = graphs.insert_graph(gm.graph, block.moved, given)
                    args += computed[block.key]
                if block.reads is not None:
                    args = [args[i] for i in block.reads]
                op = gm.graph.call_function(SHARED_BLOCK, (block.key, args))
            if block.wire is not None:
                op.meta[REDUCED_PARAMS_META] = [args[i] for i in block.wire.reduced]
            call.replace_all_uses_with(op)
            gm.graph.erase_node(call)
            gm.delete_submodule(str(call.target))
        gm.graph.lint()
        gm.recompile()
    return Sharing(run, len(shared), outcomes, list(blocks.values()), per_block, cpp_wrapper=backend.cpp_wrapper), None


def _compile(
    sub: fx.GraphModule,
    fakes: list[Any],
    fake_mode: Any,
    backend: Capabilities,
    config_patches: dict,
    reduced: tuple[int, ...],
    spec: CommSpec | None,
    invariant: tuple[int, ...],
    cost: find.DeviceCost | None,
) -> tuple[SharedBlock, CompileOutcome]:
    phases0, counts0 = dc.compile_phase_seconds(), dc.compile_counters()
    start = time.perf_counter()
    try:
        fw, bw = aot.partition(sub, fakes, fake_mode, decompose=backend.inductor)
    except Exception as exc:  # noqa: BLE001 - any failure: the block compiles with the whole graph
        why = f"AOTAutograd could not split the block on its own: {type(exc).__name__}: {exc}"
        raise graphs.NotShareable(why[:300]) from exc
    calls = [n for n in fw.graph.nodes if n.op == "call_function"]
    if random := [str(n.target) for n in calls if any(r in str(n.target) for r in _RANDOM)]:
        raise graphs.NotShareable(f"the block draws random numbers ({random[0]})")
    if any(dc.written_args(n) for n in calls):
        raise graphs.NotShareable("the block writes into one of its inputs")
    estimated = find.estimate(fw, bw, cost) if cost is not None else None  # before anything is compiled
    if estimated is not None and (why := find.refusal(estimated, cost)) is not None:
        raise find.KeptWhole(why)
    # The stages of NOTE [a shared block in stages], in order: each rewrites fw and bw in place.
    n_user = len(next(iter(sub.graph.find_nodes(op="output"))).args[0])  # a tuple (``aot.block_graph``)
    moved = graphs.move_out(fw, bw, invariant, n_user=n_user)
    reads = graphs.drop_unread(fw, bw)
    wire = None
    if reduced:  # a reduced parameter has a gradient, so the forward still takes it: at its position there
        at = tuple(i if reads is None else reads.index(i) for i in reduced)
        params = [fakes[i] for i in reduced]
        wire = graphs.BlockWire(at, spec, tuple(torch.Size(p.shape) for p in params), tuple(p.dtype for p in params))
        graphs.grads_onto_wire(bw, wire, params, fake_mode, decompose=backend.inductor)
    layout = graphs.plan_layout(n_user, fw, bw, fake_mode)
    if backend.inductor:
        fw_inputs = [n.meta["val"] for n in fw.graph.find_nodes(op="placeholder")]
        bw_inputs = [n.meta["val"] for n in bw.graph.find_nodes(op="placeholder")]
        forward = aot.inductor_compile(fw, fw_inputs, fake_mode, backward=False, config_patches=config_patches)
        backward = aot.inductor_compile(bw, bw_inputs, fake_mode, backward=True, config_patches=config_patches)
    else:
        forward, backward = aot.boxed(fw), aot.boxed(bw)
    block = SharedBlock(next(_KEYS), layout, forward, backward, wire, moved, invariant, reads, estimated)
    _BLOCKS[block.key] = block
    outcome = CompileOutcome(backend=backend.name, seconds=time.perf_counter() - start)
    phases = {k: v - phases0.get(k, 0.0) for k, v in dc.compile_phase_seconds().items()}
    outcome.phases = {k: round(v, 6) for k, v in phases.items() if v > 0}
    outcome.counts = {k: v - counts0[k] for k, v in dc.compile_counters().items() if v > counts0[k]}
    return block, outcome
