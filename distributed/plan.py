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

    def __post_init__(self) -> None:
        # 0 is a cap DDP accepts: every bucket closes after its first parameter.
        if self.first_bytes < 0 or self.bytes < 0 or any(c < 0 for c in self.per_bucket):
            raise AssertionError(f"expected bucket caps >= 0 bytes, got {self}")

    def limits(self) -> list[int]:
        if self.per_bucket:
            return list(self.per_bucket)
        return [self.first_bytes, self.bytes]

    @classmethod
    def from_ddp(
        cls,
        ddp: "DistributedDataParallel",
        *,
        bucket_cap_mb: float | None = None,
        first_bucket_cap_mb: float | None = None,
    ) -> "BucketCaps":
        """DDP's own caps, with the user's overrides (``bucket_cap_mb``, ``first_bucket_cap_mb``).

        Without overrides these are exactly the limits DDP's reducer uses when it rebuilds its
        buckets, so the plan can coincide with the reducer's real buckets.
        """
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

    def matches_ddp(self, ddp: "DistributedDataParallel") -> bool:
        first, cap, per_bucket = ddpc.bucket_caps(ddp)
        return self.limits() == (per_bucket or [first, cap])


def plan_buckets(params_in_ready_order: Sequence["GraphParam"], caps: BucketCaps) -> list[list["GraphParam"]]:
    """Group parameters (already in gradient-ready order) into buckets exactly as DDP's reducer
    would for that order: DDP's own assignment routine, keyed by dtype/device, a bucket closes
    once its bytes reach the current cap. Bucket 0 holds the first gradients of the backward."""
    params = list(params_in_ready_order)
    if not params:
        return []
    order = list(range(len(params)))
    groups = ddpc.compute_bucket_assignment([p.tensor for p in params], caps.limits(), order)
    # Buckets still open at the end come back in hash order; keep ready order.
    groups.sort(key=min)
    return [[params[i] for i in group] for group in groups]


def buckets_from_reducer(
    params: Sequence["GraphParam"], reducer_buckets: Sequence[Sequence[int]]
) -> list[list["GraphParam"]]:
    """The reducer's own (already fixed) buckets, restricted to the parameters of one graph,
    each in predicted ready order; buckets with none of the graph's parameters are dropped."""
    from ..partitioners.param_usage import ready_order

    by_index = {p.reducer_index: p for p in params}
    out = []
    for members in reducer_buckets:
        mine = [by_index[i] for i in members if i in by_index]
        if mine:
            out.append(ready_order(mine))
    return out
