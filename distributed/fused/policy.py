"""Where the fused strategy applies: one answer for the compiled module and its backend."""

from __future__ import annotations

from typing import Any

from ..._compat import ddp as ddpc
from .comm_hooks import comm_hook_kind


def why_not_fused(ddp: Any, requested: str) -> str | None:
    """Why ``requested`` (``"fused"`` or ``"auto"``) cannot run the fused strategy on this DDP
    module, so DDP's reducer keeps reducing (``split``); ``None`` where it can.

    Read at the first forward, once comm hooks are registered (they come after construction).
    """
    kind, why = comm_hook_kind(ddp)
    if kind == "unsupported":
        return f"{why}; DDP's reducer runs it, overlapping each bucket's hook with the backward"
    if requested == "auto" and ddpc.find_unused_parameters(ddp):
        # NOTE [fused and unused parameters]: fused graphs reduce the buckets of the parameters
        # they read, agreed on by all ranks at compile time. find_unused_parameters=True says
        # the ranks may read different parameters (a layer used on one rank only), which DDP's
        # reducer handles with its own protocol and fused graphs cannot. auto picks split;
        # strategy="fused" keeps fused, and ranks whose graphs differ raise RankMismatchError.
        return (
            "find_unused_parameters=True: ranks may use different parameters, which DDP's reducer "
            "handles (pass strategy='fused' if every rank uses the same parameters in every step)"
        )
    return None
