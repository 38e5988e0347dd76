"""The first backward's gradients in the planned order, so DDP's rebuilt buckets match the segments.

NOTE [first-iteration gradient order]: DDP's reducer rebuilds its buckets once, after the first
iteration, from the order in which gradients became ready. A compiled segment's backward returns
all its gradients at once and the engine accumulates them in an order of its own, so the reducer
would cut its buckets elsewhere than the segments. During that one iteration each compiled graph
gets a fresh no-op view of each parameter, made in forward first-use order. The engine runs the
highest sequence number first, so the views' backward nodes run after the graph's segments,
youngest first: gradients become ready in the reverse of first use, as the plan assumes. The
reducer then holds one bucket reduced at the end of the backward anyway, so the delay costs
nothing; afterwards parameters pass through untouched.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import torch

from ..._compat import ddp as ddpc


class FirstIterationOrder:
    """Wraps a compiled graph; until DDP has rebuilt its buckets, routes the parameters at
    ``positions`` (flat argument indices, forward first-use order) through no-op views."""

    def __init__(self, compiled: Callable[..., Any], ddp: Any, positions: Sequence[int]) -> None:
        self.compiled = compiled
        self._ddp = weakref.ref(ddp)
        self.positions = list(positions)
        self.active = bool(self.positions) and ddpc.will_rebuild(ddp)

    def __call__(self, *args: Any) -> Any:
        if self.active:
            ddp = self._ddp()
            if ddp is None or ddpc.has_rebuilt_buckets(ddp):
                self.active = False
            elif torch.is_grad_enabled():
                args = through_views(args, self.positions)
        return self.compiled(*args)


class ReadyLast:
    """Wraps a compiled graph; routes the inputs at ``positions`` through no-op views on every
    call with autograd on, so their gradients become ready after every other gradient of the graph.

    DDP's ``delay_all_reduce_named_params`` reduces from a hook on ``param_to_hook_all_reduce``'s
    gradient, which eager autograd produces last; a compiled graph hands autograd its gradients in
    no set order (NOTE [first-iteration gradient order])."""

    def __init__(self, compiled: Callable[..., Any], positions: Sequence[int]) -> None:
        self.compiled = compiled
        self.positions = list(positions)

    def __call__(self, *args: Any) -> Any:
        if torch.is_grad_enabled():
            args = through_views(args, self.positions)
        return self.compiled(*args)


def through_views(args: tuple, positions: Sequence[int]) -> tuple:
    """``args`` with the tensors at ``positions`` replaced by fresh no-op views of themselves."""
    out = list(args)
    for i in positions:
        out[i] = out[i].view_as(out[i])
    return tuple(out)
