"""The bucket plan: which parameters' gradients are reduced together, in backward order."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Sequence

from .._compat import ddp as ddpc

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

    from ..partitioners.param_usage import GraphParam

_MIB = 1024 * 1024


@dataclasses.dataclass(frozen=True, kw_only=True)
class BucketCaps:
    """Byte caps of the buckets, in gradient-ready order (DDP's reducer semantics)."""

    first_bytes: int
    """Cap of the first bucket: the gradients the backward produces first."""
    bytes: int
    """Cap of every later bucket."""
    per_bucket: tuple[int, ...] = ()
    """Explicit per-bucket caps (DDP's ``bucket_cap_mb_list``), used instead of the two above."""
    for_overlap: bool = False
    """Sized for the overlap (NOTE [fused bucket sizes]): a quarter of the gradient bytes each,
    then halving towards the end of the backward, down to ``bytes``."""

    def __post_init__(self) -> None:
        # 0 is a cap DDP accepts: every bucket closes after its first parameter.
        if self.first_bytes < 0 or self.bytes < 0 or any(c < 0 for c in self.per_bucket):
            raise AssertionError(f"expected bucket caps >= 0 bytes, got {self}")
        if self.for_overlap and self.per_bucket:
            raise AssertionError(f"expected either per-bucket caps or caps sized for the overlap, got {self}")

    def limits(self, total_bytes: int = 0) -> list[int]:
        """Caps in ready order; the last repeats (``total_bytes``: for ``for_overlap``)."""
        if self.per_bucket:
            return list(self.per_bucket)
        if self.for_overlap:
            return overlap_limits(total_bytes, self.bytes)
        return [self.first_bytes, self.bytes]

    @classmethod
    def from_ddp(
        cls,
        ddp: "DistributedDataParallel",
        *,
        bucket_cap_mb: float | None = None,
        first_bucket_cap_mb: float | None = None,
    ) -> "BucketCaps":
        """DDP's own caps (those its reducer rebuilds with), with the user's overrides."""
        ddp_first, ddp_cap, per_bucket = ddpc.bucket_caps(ddp)
        if bucket_cap_mb is None and first_bucket_cap_mb is None:
            return cls(first_bytes=ddp_first, bytes=ddp_cap, per_bucket=tuple(per_bucket))
        cap = int(bucket_cap_mb * _MIB) if bucket_cap_mb is not None else ddp_cap
        if first_bucket_cap_mb is not None:
            first = int(first_bucket_cap_mb * _MIB)
        else:
            # Keep DDP's small-first-bucket rule: 1 MiB first only when DDP uses it.
            first = min(ddp_first, cap) if ddp_first < ddp_cap else cap
        return cls(first_bytes=first, bytes=cap)

    def for_fused(self, ddp: "DistributedDataParallel", *, overridden: bool, plain: bool) -> "BucketCaps":
        """See NOTE [fused bucket sizes]."""
        if plain and not overridden and ddpc.default_bucket_caps(ddp):
            return dataclasses.replace(self, for_overlap=True)
        return self

    def matches_ddp(self, ddp: "DistributedDataParallel") -> bool:
        first, cap, per_bucket = ddpc.bucket_caps(ddp)
        return not self.for_overlap and self.limits() == (per_bucket or [first, cap])

    def describe(self) -> str:
        if self.for_overlap:
            return f"sized for the overlap: a quarter of the gradient bytes, halving down to {self.bytes / _MIB:g} MiB"
        return "caps " + ", ".join(f"{c / _MIB:g}" for c in self.limits()) + " MiB"


# NOTE [fused bucket sizes]: under ``fused`` each traced collective costs the host about the same
# whatever its size, and overlap only needs each all-reduce done before the backward ends. So
# buckets are a quarter of the gradient bytes, then halving (1/4, 1/4, 1/4, 1/8, ...) down to
# DDP's cap: few collectives, an exposed tail of one small bucket (while all-reducing takes at
# most half the backward). Not one bucket even on one rank: its buffer would raise the peak.
# Default only with DDP's default caps and plain buckets; user caps, and DDP's buckets for hooks
# that see them (PowerSGD, traceable hooks), are kept.


def overlap_limits(total_bytes: int, floor: int) -> list[int]:
    """See NOTE [fused bucket sizes]; the last cap repeats."""
    out, remaining = [], total_bytes
    while remaining > floor:
        size = max(floor, min(total_bytes // 4, remaining // 2))
        out.append(size)
        remaining -= size
    return out if out and out[-1] == floor else out + [floor]


def plan_buckets(params_in_ready_order: Sequence["GraphParam"], caps: BucketCaps) -> list[list["GraphParam"]]:
    """Buckets as DDP's reducer would make them for this ready order (its own routine)."""
    params = list(params_in_ready_order)
    if not params:
        return []
    order = list(range(len(params)))
    limits = caps.limits(sum(p.nbytes for p in params))
    groups = ddpc.compute_bucket_assignment([p.tensor for p in params], limits, order)
    # Buckets still open at the end come back in hash order; keep ready order.
    groups.sort(key=min)
    return [[params[i] for i in group] for group in groups]


def buckets_from_reducer(
    params: Sequence["GraphParam"], reducer_buckets: Sequence[Sequence[int]]
) -> list[list["GraphParam"]]:
    """The reducer's fixed buckets restricted to one graph's parameters (empty ones dropped)."""
    from ..partitioners.param_usage import ready_order

    by_index = {p.reducer_index: p for p in params}
    out = []
    for members in reducer_buckets:
        mine = [by_index[i] for i in members if i in by_index]
        if mine:
            out.append(ready_order(mine))
    return out
