"""Where DDP's reducer, which runs the comm hook under ``split``, would stop training for good.

NOTE [PowerSGD on gloo]: torch's ``powerSGD_hook`` and ``batched_powerSGD_hook`` issue their P
and Q all-reduces from future callbacks and wait for them there. gloo runs a future's callbacks
on the worker threads that run its collectives (two by default), so as many buckets in their
callbacks at once leave no thread for those all-reduces: training stops at the first compressed
step, in eager DDP too (benchmarks/results/2026-12-03_cpu-1rank_powersgd-gloo-deadlock). NCCL
runs callbacks elsewhere. ``fused`` runs its own PowerSGD program for ``powerSGD_hook``, with the
all-reduces traced into the backward, so only ``split`` (and a fallback to it) is refused.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ..._compat import c10d, ddp_hooks
from ..._compat import ddp as ddpc
from ..plan import BucketCaps


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReducerStop:
    """DDP's reducer would wait for good in torch's PowerSGD hook on gloo (NOTE [PowerSGD on gloo])."""

    hook: str
    """``powerSGD_hook`` or ``batched_powerSGD_hook``."""
    threads: int
    """gloo's worker threads."""
    buckets: int
    """DDP's buckets by its caps (at least ``threads``)."""
    start_iter: int
    one_bucket_mb: int
    """A ``bucket_cap_mb`` that makes one bucket of every gradient."""
    fused_applies: bool
    """``fused`` could run this DDP module (an explicit ``split``)."""

    def __str__(self) -> str:
        return (
            f"DDP's reducer runs torch's {self.hook}, which on a gloo process group stops training for good at its "
            f"first compressed step (start_powerSGD_iter {self.start_iter}), as in eager DDP: its future callbacks "
            f"wait for all-reduces that only gloo's {self.threads} worker threads run, and {self.buckets} buckets "
            "can hold them all (NOTE [PowerSGD on gloo])"
        )

    @property
    def fix(self) -> str:
        one_bucket = f"DDP(..., bucket_cap_mb={self.one_bucket_mb}) for one bucket"
        if self.hook == "powerSGD_hook" and self.fused_applies:
            return f"Pass strategy='auto' (bucketwise runs its own PowerSGD program in the backward), or {one_bucket}"
        if self.hook == "batched_powerSGD_hook":
            return f"Register powerSGD_hook instead (the default runs bucketwise's own program for it), or {one_bucket}"
        return f"Give {one_bucket}"


def reducer_stop(ddp: Any, *, fused_applies: bool) -> ReducerStop | None:
    """Why DDP's reducer would stop running this DDP module's comm hook, or ``None``."""
    registered = ddp_hooks.comm_hook(ddp)
    if registered is None:
        return None
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

    hook, state = registered
    if hook not in (ps.powerSGD_hook, ps.batched_powerSGD_hook):
        return None
    params = [p for _, p in ddpc.reducer_parameters(ddp)]
    if not params:
        return None
    import torch.distributed as dist

    pg = state.process_group if state.process_group is not None else dist.group.WORLD
    threads = c10d.gloo_threads(pg, params[0].device)
    if threads is None:
        return None
    limits = BucketCaps.from_ddp(ddp).limits()  # the reducer's own caps: split keeps DDP's buckets
    order = list(reversed(range(len(params))))  # about the order gradients become ready
    buckets = len(ddpc.compute_bucket_assignment(params, limits, order))
    if buckets < threads:
        return None
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    return ReducerStop(
        hook=hook.__name__,
        threads=threads,
        buckets=buckets,
        start_iter=int(state.start_powerSGD_iter),
        one_bucket_mb=max(1, math.ceil(grad_bytes / 2**20)),
        fused_applies=fused_applies,
    )
