"""Split a Dynamo graph into segments at gradient-bucket boundaries (an FX pass)."""

from __future__ import annotations

import bisect
import dataclasses
import logging
from typing import Callable, Sequence

import torch.fx as fx
from torch.fx.passes.split_module import split_module

from .param_usage import GraphParam
from .regions import outside_regions, transform_regions

log = logging.getLogger(__name__)

# Namespaced node.meta key: the segment a node was assigned to.
SEGMENT_META_KEY = "bucketwise.segment"


@dataclasses.dataclass
class Segment:
    """One piece of a split graph: a submodule of the split GraphModule."""

    index: int
    """Forward order (segment 0 runs first in the forward, its gradients come last)."""
    submodule: str
    """Attribute name of the piece in the split GraphModule (``submod_0``, ...)."""
    params: list[GraphParam]
    """Reducer parameters whose first use lies in this segment."""
    op_count: int = 0
    """FX call nodes in the segment."""


def bucket_boundaries(gm: fx.GraphModule, buckets: Sequence[Sequence[GraphParam]]) -> Callable[[fx.Node], int]:
    """Node -> segment (forward order): as many segments as keep every bucket's parameters' first
    uses in one, and no cut inside a torch.func region. Each bucket spans its parameters' first
    uses; overlapping spans merge (non-contiguous buckets share a segment); a cut starts each."""
    ranges = sorted(
        (min(uses), max(uses)) for uses in ([p.first_use for p in b if p.first_use >= 0] for b in buckets) if uses
    )
    starts: list[int] = []
    end = -1
    for lo, hi in ranges:
        if lo > end:
            starts.append(lo)
        end = max(end, hi)
    regions = transform_regions(gm)
    starts = sorted({outside_regions(s, regions) for s in starts})
    starts = [0] + [s for s in starts if s > 0]
    order = {node: i for i, node in enumerate(gm.graph.nodes)}

    def segment_of(node: fx.Node) -> int:
        return bisect.bisect_right(starts, order[node]) - 1

    return segment_of


def split_graph(
    gm: fx.GraphModule, segment_of: Callable[[fx.Node], int], params: Sequence[GraphParam]
) -> tuple[fx.GraphModule, list[Segment]]:
    """A GraphModule calling one submodule per segment; nodes keep their meta, plus the segment."""
    log.debug("graph before split:\n%s", LazyGraph(gm))
    ids: dict[int, int] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        seg = segment_of(node)
        node.meta[SEGMENT_META_KEY] = seg
        ids.setdefault(seg, len(ids))
    split_gm = split_module(gm, None, lambda n: n.meta[SEGMENT_META_KEY], keep_original_order=True)

    by_segment: dict[int, list[GraphParam]] = {}
    for p in params:
        if p.first_use >= 0:
            by_segment.setdefault(_first_user_segment(p), []).append(p)

    segments = []
    for seg in sorted(ids):
        name = f"submod_{seg}"
        if not hasattr(split_gm, name):
            raise AssertionError(f"expected split_module to create {name}, got {list(dict(split_gm.named_children()))}")
        sub = getattr(split_gm, name)
        op_count = sum(1 for n in sub.graph.nodes if n.op.startswith("call_"))
        segments.append(Segment(index=len(segments), submodule=name, params=by_segment.get(seg, []), op_count=op_count))
    log.debug("graph after split:\n%s", LazyGraph(split_gm))
    return split_gm, segments


def _first_user_segment(p: GraphParam) -> int:
    return min(u.meta[SEGMENT_META_KEY] for u in p.node.users if SEGMENT_META_KEY in u.meta)


class LazyGraph:
    """Formats a graph only if the log record is emitted."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm

    def __str__(self) -> str:
        return str(self.gm.graph)
