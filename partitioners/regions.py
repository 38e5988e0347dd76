"""Stretches of a Dynamo graph that must not be cut or interleaved with bucket syncs.

Dynamo inlines ``torch.func`` transforms between ``_*_increment_nesting`` and
``_*_decrement_nesting`` calls. A cut inside would hand a ``BatchedTensor`` from one segment to the
next, and an ``autograd.Function`` placed inside would run under the transform. Higher-order ops
(checkpoint, ``cond``, ...) are single nodes and need no region.
"""

from __future__ import annotations

import bisect

import torch.fx as fx


def _name(node: fx.Node) -> str:
    return getattr(node.target, "__name__", "") if node.op == "call_function" else ""


def transform_regions(gm: fx.GraphModule) -> list[tuple[int, int]]:
    """Outermost ``(start, end)`` node positions (inclusive) of inlined functorch transforms."""
    regions = []
    depth, start = 0, 0
    for i, node in enumerate(gm.graph.nodes):
        name = _name(node)
        if name.endswith("_increment_nesting"):
            if depth == 0:
                start = i
            depth += 1
        elif name.endswith("_decrement_nesting") and depth > 0:
            depth -= 1
            if depth == 0:
                regions.append((start, i))
    if depth > 0:  # unbalanced (should not happen): protect up to the end
        regions.append((start, len(gm.graph.nodes) - 1))
    return regions


def outside_regions(position: int, regions: list[tuple[int, int]]) -> int:
    """``position``, moved to the start of the transform region that contains it, if any."""
    starts = [s for s, _ in regions]
    k = bisect.bisect_right(starts, position) - 1
    if k >= 0 and regions[k][0] < position <= regions[k][1]:
        return regions[k][0]
    return position
