"""Where the fused strategy applies: one answer for the compiled module and its backend."""

from __future__ import annotations

from typing import Any, Collection

from ..._compat import ddp as ddpc
from ..._compat import hooks as hc
from .hook_kinds import HookKind


def why_not_fused(ddp: Any, requested: str, *, comm_hook: HookKind, hooked: Collection[str]) -> str | None:
    """Why ``fused`` cannot run on this DDP module (then ``split``), or ``None``. Read at the first
    forward (comm hooks are registered after construction) and whenever the hooks change."""
    if comm_hook.unsupported is not None:
        return f"{comm_hook.unsupported}; DDP's reducer runs it, overlapping each bucket's hook with the backward"
    if hooked:
        shown = ", ".join(list(hooked)[:3]) + (f" and {len(hooked) - 3} more" if len(hooked) > 3 else "")
        return (
            f"gradient hooks on {shown}: eager DDP runs them on each rank's own gradient before reducing it, "
            "which DDP's reducer does and a fused backward cannot (NOTE [gradient hooks before the reduction])"
        )
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


def hooked_gradients(ddp: Any, *, own: Collection[int] = ()) -> list[str]:
    """Reducer parameters with a user's gradient hook (not ours, ``own``, nor DDP's delayed allreduce).

    NOTE [gradient hooks before the reduction]: in eager DDP a parameter's gradient hooks (a tensor
    hook before accumulation, a post-accumulate-grad hook right after) run on the rank's own
    gradient before the reducer reduces it, so a hook that is not linear (clamping, masking rows,
    a per-rank scale) depends on that order. The fused backward reduces inside the compiled graph,
    before autograd hands the gradient to those hooks. Such a module runs ``split`` under ``auto``
    and ``fused``, with the parameters named in the report; the hooks are checked again when they
    change (``compiler/hook_watch.py``). Module backward hooks act on activations' gradients, which
    the graph computes before any gradient it reduces: they keep eager DDP's result.
    """
    delayed = ddpc.delayed_allreduce_hook(ddp)
    own = set(own)
    out = []
    for name, p in ddpc.reducer_parameters(ddp):
        tensor = [h for key, h in hc.tensor_hooks(p).items() if key not in own and h != delayed]
        post = [key for key in hc.post_accumulate_hooks(p) if key not in own]
        if tensor or post:
            out.append(name)
    return out
