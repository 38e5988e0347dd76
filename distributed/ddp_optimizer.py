"""bucketwise's DDP optimizer: cut each Dynamo graph at gradient-bucket boundaries.

NOTE [split strategy]: DDP's reducer launches a bucket's allreduce as soon as the last gradient
of the bucket is accumulated. A compiled graph produces all of its gradients only when its whole
backward has run, so a single compiled graph delays every allreduce to the end of the backward.
Cutting the graph so that each bucket's parameters are first used in their own segment lets each
segment's backward finish a bucket, and NCCL reduces it while earlier segments still compute.
The plan uses the reducer's own assignment routine and caps, so once the reducer has rebuilt its
buckets from the real gradient-ready order they coincide with the segments (``alignment``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Sequence

import torch.fx as fx

from ..compiler.progress import Progress
from ..compiler.segments import CompileOutcome, compile_segments
from ..partitioners.param_usage import GraphParam, ready_order
from ..partitioners.split import Segment, bucket_boundaries, split_graph
from .._compat import ddp as ddpc
from .plan import BucketCaps, buckets_from_reducer, plan_buckets

log = logging.getLogger(__name__)


@dataclasses.dataclass
class SplitResult:
    compiled: Callable[..., Any]
    segments: list[Segment]
    outcomes: list[CompileOutcome]


def plan_for_graph(ddp: Any, params: Sequence[GraphParam], caps: BucketCaps) -> tuple[list[list[GraphParam]], str]:
    """Buckets for one graph and where they come from.

    ``"reducer"``: DDP's buckets are already final (``find_unused_parameters=True`` never
    rebuilds; or the reducer has rebuilt before this graph was compiled) and the caps are DDP's:
    follow them. ``"predicted"``: DDP's assignment routine over the predicted ready order; the
    reducer will rebuild to the same buckets (NOTE [first-iteration gradient order]).
    """
    if caps.matches_ddp(ddp):
        known = ddpc.fixed_buckets(ddp)
        if known is not None:
            return buckets_from_reducer(params, known), "reducer"
    return plan_buckets(ready_order(params), caps), "predicted"


def split_and_compile(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    params: Sequence[GraphParam],
    buckets: Sequence[Sequence[GraphParam]],
    compile_whole: Callable[[fx.GraphModule, Sequence[Any]], tuple[Callable[..., Any], CompileOutcome]],
    backend_fn: Callable[..., Any],
    *,
    backend_name: str,
    fallback: str,
    progress: Progress,
) -> SplitResult:
    """Split ``gm`` at ``buckets`` (gradient-ready order) and compile each segment.

    A graph whose parameters fit in one bucket is compiled whole (one segment).
    """
    log.debug("bucket plan: %s", [[p.name for p in b] for b in buckets])
    used = [p for p in params if p.first_use >= 0]
    if len(buckets) <= 1:
        with progress.step("segment 1/1", backend_name):
            compiled, outcome = compile_whole(gm, example_inputs)
        segment = Segment(index=0, submodule="", params=list(used), op_count=_op_count(gm))
        return SplitResult(compiled, [segment], [outcome])

    segment_of = bucket_boundaries(gm, buckets)
    split_gm, segments = split_graph(gm, segment_of, used)
    outcomes = compile_segments(
        split_gm, example_inputs, backend_fn, backend_name=backend_name, fallback=fallback, progress=progress
    )
    if len(outcomes) != len(segments):
        raise AssertionError(f"expected {len(segments)} compiled segments, got {len(outcomes)}")
    return SplitResult(split_gm, segments, outcomes)


def _op_count(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op.startswith("call_"))
