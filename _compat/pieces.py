"""Fake values and tracing contexts for compiling ``split``'s segments and comm-hook variants
outside Dynamo's own compile. Checked on torch 2.13.0 (CI) and 2.11.0 (device machines)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch._dynamo
import torch._guards


def detect_fake_mode(example_inputs: Any):
    mode = torch._guards.detect_fake_mode(example_inputs)
    if mode is None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode()
    return mode


def to_fake(value: Any, fake_mode) -> Any:
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
        return torch._dynamo.utils.to_fake_tensor(value, fake_mode)
    return value


@contextlib.contextmanager
def allow_real_inputs(fake_mode) -> Iterator[None]:
    """Run under ``fake_mode`` while parameters are still real tensors (scoped, restored)."""
    old = fake_mode.allow_non_fake_inputs
    fake_mode.allow_non_fake_inputs = True
    try:
        with fake_mode:
            yield
    finally:
        fake_mode.allow_non_fake_inputs = old


def graph_example_inputs(gm: Any, example_inputs: Any) -> list[Any]:
    """Dynamo's fake values of a graph's inputs (its dynamic sizes), else the example given: real
    tensors would be fakified with every size dynamic."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return [n.meta.get("example_value", given) for n, given in zip(placeholders, example_inputs)]


@contextlib.contextmanager
def fresh_tracing(fake_mode) -> Iterator[None]:
    """For one more AOTAutograd compile of a Dynamo graph, its forward metadata apart from Dynamo's."""
    with torch._guards.tracing(torch._guards.TracingContext(fake_mode)):
        yield


def fake_empty(fake_mode, shape: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A fake tensor with static sizes in ``fake_mode``."""
    with fake_mode:
        return torch.empty(shape, dtype=dtype, device=device)


def mark_static_address(t: torch.Tensor) -> None:
    """A tensor keeping its address across calls, read in place by CUDA-graph runners."""
    torch._dynamo.mark_static_address(t, guard=False)


def saved_tensor_hooks_disabled():
    return torch._dynamo.utils._disable_saved_tensors_hooks_during_tracing()


class _SegmentMetadata:
    """Duck-typed stand-in for ``torch._dynamo.backends.distributed.DDPOptimizerContext``.

    NOTE [several AOT graphs per Dynamo graph]: when one Dynamo graph becomes N AOTAutograd
    graphs, AOTAutograd's lazily compiled backward (dynamic shapes) looks up each graph's
    forward metadata on ``TracingContext.ddp_optimizer_ctx`` (a list plus a cursor that the
    backward walks in reverse). Without it, backward N-1 would be compiled against graph N's
    metadata. We keep our own object with the same two attributes; torch reads only those.
    """

    def __init__(self) -> None:
        self.curr_bucket: int = -1
        self.metadata_per_bucket: list[Any] = []


class SegmentTracing:
    """The per-segment bookkeeping AOTAutograd/Inductor expect when a Dynamo graph is split."""

    def __init__(self) -> None:
        self.ctx = torch._guards.TracingContext.try_get()
        if self.ctx is not None and hasattr(self.ctx, "ddp_optimizer_ctx"):
            self.ctx.ddp_optimizer_ctx = _SegmentMetadata()

    @contextlib.contextmanager
    def compiling_segment(self) -> Iterator[None]:
        """``fakify_first_call``: the next segment compiles against the strides this one produces."""
        if self.ctx is None or not hasattr(self.ctx, "fakify_first_call"):
            yield
            return
        self.ctx.fakify_first_call = True
        try:
            yield
        finally:
            self.ctx.fakify_first_call = False

    def record_segment_metadata(self) -> bool:
        """After an AOTAutograd compile: stash its forward metadata for the lazy backward."""
        seg_ctx = getattr(self.ctx, "ddp_optimizer_ctx", None) if self.ctx else None
        if seg_ctx is None or getattr(self.ctx, "fw_metadata", None) is None:
            return False
        seg_ctx.curr_bucket += 1
        seg_ctx.metadata_per_bucket.append(self.ctx.fw_metadata)
        return True
