"""The split strategy: cut each Dynamo graph at gradient-bucket boundaries.

NOTE [split strategy]: a single compiled graph produces all gradients at the end of its backward,
delaying every allreduce of DDP's reducer. Cutting it so each bucket's parameters are first used
in their own segment lets each segment's backward complete a bucket, reduced while earlier
segments compute. The plan uses the reducer's own routine and caps, so its rebuilt buckets
coincide with the segments (``alignment``).
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from ..._compat import ddp as ddpc
from ..._compat import dynamo as dc
from ..._compat import pieces
from ...partitioners.param_usage import GraphParam, ready_order
from ...partitioners.split import Segment, bucket_boundaries, split_graph
from ..plan import BucketCaps, buckets_from_reducer, plan_buckets
from ..result import CompileOutcome, GraphJob, PieceCompiler, StrategyResult, bucket_stats, falls_back, op_count
from ..whole import apply_whole

log = logging.getLogger(__name__)


def apply_split(
    job: GraphJob, compiler: PieceCompiler, *, earlier_names: set[str], caps: BucketCaps, fallback: str
) -> StrategyResult:
    """Plan buckets, cut the graph at them, compile each segment; compiled whole where it cannot
    be cut. ``earlier_names``: parameters an earlier graph also reads, planned there only."""
    ddp = job.ddp
    params = [p for p in job.params if p.name not in earlier_names]
    job = dataclasses.replace(job, params=params)
    notes = []
    if not caps.matches_ddp(ddp):
        notes.append(
            f"bucket caps {caps.limits()} differ from the DDP module's own: its reducer keeps "
            "its buckets, so they will not coincide with the segments (see alignment)"
        )
    buckets, source = plan_for_graph(ddp, params, caps)
    depth = dc.functorch_depth()
    try:
        fn, segments, outcomes = split_and_compile(job, buckets, compiler)
    except Exception as exc:
        if not falls_back(exc, fallback=fallback, functorch_depth=depth):
            raise
        # Splitting itself failed (an op torch.fx's splitter cannot carry across a cut).
        log.warning("bucketwise: could not split graph, compiling it whole: %s", exc)
        whole = apply_whole(job, compiler)
        whole.notes[:0] = [
            *notes,
            f"a graph could not be split and was compiled whole: {type(exc).__name__}: {exc}"[:300],
        ]
        return whole
    seg_of = {p.name: seg.index for seg in segments for p in seg.params}
    stats = [bucket_stats(i, b, seg_of) for i, b in enumerate(buckets)]
    return StrategyResult(fn=fn, segments=segments, outcomes=outcomes, buckets=stats, plan_source=source, notes=notes)


def plan_for_graph(ddp: Any, params: Sequence[GraphParam], caps: BucketCaps) -> tuple[list[list[GraphParam]], str]:
    """Buckets for one graph and their source: ``"reducer"`` (DDP's buckets are final) or
    ``"predicted"`` (NOTE [first-iteration gradient order])."""
    if caps.matches_ddp(ddp):
        known = ddpc.fixed_buckets(ddp)
        if known is not None:
            return buckets_from_reducer(params, known), "reducer"
    return plan_buckets(ready_order(params), caps), "predicted"


def split_and_compile(
    job: GraphJob, buckets: Sequence[Sequence[GraphParam]], compiler: PieceCompiler
) -> tuple[Callable[..., Any], list[Segment], list[CompileOutcome]]:
    """Split the graph at ``buckets`` and compile each segment (one bucket: whole)."""
    log.debug("bucket plan: %s", [[p.name for p in b] for b in buckets])
    gm = job.gm
    used = [p for p in job.params if p.first_use >= 0]
    if len(buckets) <= 1:
        compiled, outcome = compiler.piece(gm, job.example_inputs, label=f"{job.label} segment 0", what="segment 1/1")
        return compiled, [Segment(index=0, submodule="", params=list(used), op_count=op_count(gm))], [outcome]
    segment_of = bucket_boundaries(gm, buckets)
    split_gm, segments = split_graph(gm, segment_of, used)
    outcomes = compile_segments(split_gm, job, compiler)
    if len(outcomes) != len(segments):
        raise AssertionError(f"expected {len(segments)} compiled segments, got {len(outcomes)}")
    return split_gm, segments, outcomes


class _SegmentCall(torch.nn.Module):
    """Holds a compiled segment in the split GraphModule; unwraps the 1-tuple AOT needs."""

    def __init__(self, fn: Callable[..., Any], unwrap: bool) -> None:
        super().__init__()
        self.fn = fn
        self.unwrap = unwrap

    def forward(self, *args: Any) -> Any:
        out = self.fn(*args)
        if self.unwrap and isinstance(out, (tuple, list)):
            return out[0]
        return out


def _force_tuple_output(gm: fx.GraphModule) -> bool:
    """AOTAutograd-based backends need a tuple output; returns whether one was added."""
    out = next(iter(gm.graph.find_nodes(op="output")))
    if isinstance(out.args[0], (tuple, list)):
        return False
    out.args = ((out.args[0],),)
    gm.recompile()
    return True


def compile_segments(split_gm: fx.GraphModule, job: GraphJob, compiler: PieceCompiler) -> list[CompileOutcome]:
    """Compile every ``submod_*`` in forward order, in place, each against the strides the
    previous segment really produces (NOTE [several AOT graphs per Dynamo graph])."""
    fake_mode = pieces.detect_fake_mode(job.example_inputs)
    tracing = pieces.SegmentTracing()
    env: dict[fx.Node, Any] = {}
    placeholders = iter(job.example_inputs)
    outcomes: list[CompileOutcome] = []
    calls = [n for n in split_gm.graph.nodes if n.op == "call_module"]

    def load(arg: Any) -> Any:
        return fx.node.map_arg(arg, lambda n: env[n])

    with pieces.saved_tensor_hooks_disabled():
        for node in split_gm.graph.nodes:
            if node.op == "placeholder":
                env[node] = pieces.to_fake(next(placeholders), fake_mode)
            elif node.op == "call_module":
                env[node] = _compile_segment(
                    split_gm,
                    node,
                    tuple(pieces.to_fake(a, fake_mode) for a in load(node.args)),
                    compiler,
                    job.label,
                    tracing,
                    fake_mode,
                    outcomes,
                    len(calls),
                )
            elif node.op == "call_function":
                if node.target is not operator.getitem:
                    raise AssertionError(f"expected only getitem between segments, got {node.format_node()}")
                env[node] = node.target(*load(node.args))
    split_gm.recompile()
    # Drop the uncompiled pieces (still reachable through compiled wrappers if they fell back).
    for node in calls:
        original = str(node.target).removeprefix("compiled_")
        if hasattr(split_gm, original):
            split_gm.delete_submodule(original)
    return outcomes


def _compile_segment(
    split_gm: fx.GraphModule,
    node: fx.Node,
    args: tuple,
    compiler: PieceCompiler,
    label: str,
    tracing: Any,
    fake_mode: Any,
    outcomes: list[CompileOutcome],
    total: int,
) -> Any:
    """Compile one segment in place of ``node``; its (fake) outputs, for the segments after it."""
    submod = getattr(split_gm, str(node.target))
    unwrap = _force_tuple_output(submod)
    aot_before = dc.aot_autograd_count()
    index = len(outcomes)
    compiled, outcome = compiler.piece(
        submod, args, label=f"{label} segment {index}", what=f"segment {index + 1}/{total}", tracing=tracing
    )
    outcomes.append(outcome)
    wrapper = _SegmentCall(compiled, unwrap)
    name = f"compiled_{node.target}"
    split_gm.add_submodule(name, wrapper)
    node.target = name
    with pieces.allow_real_inputs(fake_mode):
        if not outcome.fell_back and dc.aot_autograd_count() != aot_before and tracing.record_segment_metadata():
            return wrapper(*args)
        out = submod(*args)
        return out[0] if unwrap else out
