"""Which strategy a graph gets: the one decision, made here for every caller."""

from __future__ import annotations

import dataclasses
from typing import Any

from .._compat import ddp as ddpc
from ..distributed.fused.policy import why_not_fused


@dataclasses.dataclass(frozen=True)
class StrategyChoice:
    strategy: str
    """``"fused"``, ``"split"`` or ``"none"``."""
    reason: str | None = None
    """Why it is not the requested one (``None`` where it is, or nothing was requested)."""


def resolve_strategy(
    requested: str, ddp: Any | None, *, runs_ddp_forward: bool, variant: str | None = None
) -> StrategyChoice:
    """The strategy for ``requested`` (``auto``, ``fused``, ``split``, ``none``) on ``ddp`` (``None``:
    no DDP module). ``runs_ddp_forward``: bucketwise runs the DDP forward itself (it compiled the
    DDP module), which ``fused`` needs; ``variant``: ``"no_sync"`` for the graphs of ``no_sync()``
    steps. Read at the first forward, when comm hooks are registered (they come after
    construction), and for every graph compiled."""
    if requested == "none":
        return StrategyChoice("none", "no_sync(): no gradient communication" if variant == "no_sync" else None)
    if ddp is None:
        return StrategyChoice("none", "no DDP module: no gradient buckets" if requested in ("split", "fused") else None)
    if ddpc.uses_python_reducer(ddp):
        return StrategyChoice("none", "DDP's python reducer (compiled autograd) does its own bucketing")
    if requested == "split":
        return StrategyChoice("split")
    blocker = why_not_fused(ddp, requested)
    if blocker is not None:
        return StrategyChoice("split", blocker)
    if not runs_ddp_forward:
        return StrategyChoice("split", "fused needs bucketwise to run the DDP forward: compile the DDP module itself")
    return StrategyChoice("fused")
