"""DDP comm hooks other than torch's allreduce/fp16/bf16 ones, under the fused strategy.

NOTE [comm hooks in the graph]: ``fused`` reduces inside the compiled backward, so it must
reproduce the comm hook there: allreduce/fp16/bf16 hooks (``BucketSync``), ``powerSGD_hook``
(NOTE [powersgd in the graph]) and hooks wrapped in ``traceable_comm_hook`` (``HookSync``).
Other hooks cannot be traced; ``auto`` then picks ``split`` and the report says why. A hook with
per-step host state is a :class:`HookProgram`; its graph a :class:`HookedGraph` compiled once
per variant, extra inputs (state tensors, accumulated gradients) after Dynamo's.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Hashable, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx

from ..._compat import collectives as cc
from ...partitioners.param_usage import GraphParam
from .sync import CommSpec, filled_grads, insert_bucket_syncs, split_like

log = logging.getLogger(__name__)

PLAIN = ("plain",)
"""The variant that all-reduces buckets like ``allreduce_hook`` (``fused.BucketSync``)."""

InputSpec = tuple[tuple[int, ...], torch.dtype, torch.device]


class HookProgram:
    """What a comm hook decides on the host for the graphs that reproduce it."""

    name = "hook"

    def __init__(self) -> None:
        self._keys: dict[tuple[int, ...], int] = {}

    def key(self, bucket: Sequence[GraphParam]) -> int:
        """``GradBucket.index()``: numbered in compile order, stable across recompiles."""
        return self._keys.setdefault(tuple(p.reducer_index for p in bucket), len(self._keys))

    def bucket_count(self) -> int:
        """Buckets numbered so far, over every graph."""
        return len(self._keys)

    def plain_spec(self) -> CommSpec:
        raise NotImplementedError

    def variant(self, graph: "HookedGraph") -> Hashable:
        """The variant the graph runs this call (``PLAIN`` or the program's own)."""
        raise NotImplementedError

    def input_specs(self, variant: Hashable, graph: "HookedGraph") -> list[InputSpec]:
        """Shape, dtype, device of each extra input the variant takes."""
        return []

    def inputs(self, variant: Hashable, graph: "HookedGraph") -> list[torch.Tensor]:
        """The extra inputs of this call (side effects: the program's per-step host work)."""
        return []

    def insert(
        self, gm: fx.GraphModule, buckets: Sequence[Sequence[GraphParam]], variant: Hashable, extra: Sequence[fx.Node]
    ) -> None:
        """Graph pass: the variant's syncs (``extra``: placeholders, as ``input_specs``)."""
        raise NotImplementedError

    def variant_name(self, variant: Hashable) -> str:
        raise NotImplementedError

    def wire(self, bucket: Sequence[GraphParam]) -> tuple[str, int | None, dict[str, int] | None]:
        """For the report: collective name, bytes per rank and step, and per collective."""
        raise NotImplementedError

    def describe(self) -> str:
        return self.name

    def after_synced_forward(self) -> None:
        """Once per synced step, after every graph's forward."""


class HookedGraph:
    """One graph compiled once per variant, picked per call (NOTE [powersgd in the graph])."""

    def __init__(
        self,
        program: HookProgram,
        buckets: Sequence[Sequence[GraphParam]],
        compile_variant: Callable[[Hashable, list[InputSpec]], Callable[..., Any]],
    ) -> None:
        self.program = program
        self.buckets = [list(b) for b in buckets]
        self.keys = [program.key(b) for b in self.buckets]
        self._compile_variant = compile_variant
        self.compiled: dict[Hashable, Callable[..., Any]] = {}

    def ensure(self, variant: Hashable) -> Callable[..., Any]:
        fn = self.compiled.get(variant)
        if fn is None:
            fn = self.compiled[variant] = self._compile_variant(variant, self.program.input_specs(variant, self))
        return fn

    def __call__(self, *args: Any) -> Any:
        variant = self.program.variant(self)
        fn = self.ensure(variant)
        return fn(*args, *self.program.inputs(variant, self))


def has_grads(buckets: Sequence[Sequence[GraphParam]]) -> bool:
    """Gradients are already there (``no_sync()`` micro-steps, gradients not zeroed)."""
    return any(p.tensor.grad is not None for b in buckets for p in b)


def take_grads(bucket: Sequence[GraphParam]) -> torch.Tensor:
    """The bucket's gradients, flat, then cleared: the backward adds them before the hook."""
    parts = []
    for p in bucket:
        g = p.tensor.grad
        parts.append(g.detach().reshape(-1) if g is not None else p.tensor.new_zeros(p.tensor.numel()))
        p.tensor.grad = None
    return torch.cat(parts)


def bucket_input_spec(bucket: Sequence[GraphParam], numel: int) -> InputSpec:
    first = bucket[0].tensor
    return (int(numel),), first.dtype, first.device


# --- user hooks written with functional collectives ----------------------------------------


class TraceableCommHook:
    """See :func:`traceable_comm_hook`."""

    def __init__(self, fn: Callable[[Any, Any], torch.Tensor]) -> None:
        if not callable(fn):
            raise TypeError(f"traceable_comm_hook expects a function (state, bucket) -> Tensor, got {fn!r}")
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)
        self.__doc__ = getattr(fn, "__doc__", None)

    def __call__(self, state, bucket):
        """DDP's reducer (eager DDP, ``split``): the same function on the real bucket."""
        out = cc.wait(self.fn(state, bucket))
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(out)
        return fut

    def __repr__(self) -> str:
        return f"traceable_comm_hook({self.__qualname__})"


# DDP checks these two annotations (with the objects, not strings).
TraceableCommHook.__call__.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}


def traceable_comm_hook(fn: Callable[[Any, Any], torch.Tensor]) -> TraceableCommHook:
    """Mark a comm hook as traceable into the compiled backward of ``strategy="fused"``.

    ``fn(state, bucket)`` returns the reduced bucket as one flat tensor like
    ``bucket.buffer()``, computed with functional collectives (not ``dist.all_reduce``
    futures). Register it like any hook. ``fused`` traces it once per bucket and variant with a
    bucket offering ``buffer()``, ``gradients()``, ``index()`` and ``is_last()``, so host-side
    effects in ``fn`` happen at trace time, not every step."""
    return TraceableCommHook(fn)


class GraphBucket:
    """What a traceable hook gets in the compiled backward instead of ``dist.GradBucket``."""

    def __init__(self, buffer: torch.Tensor, like: Sequence[torch.Tensor], index: int, last: bool) -> None:
        self._buffer, self._like, self._index, self._last = buffer, list(like), index, last

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer = tensor

    def gradients(self) -> list[torch.Tensor]:
        return split_like(self._buffer, self._like)

    def parameters(self) -> list[torch.Tensor]:
        raise NotImplementedError(
            "bucket.parameters() is not available to a traceable comm hook in the compiled backward; "
            "use bucket.gradients() (same order and shapes), or register the hook without "
            "traceable_comm_hook so DDP's reducer runs it (strategy='split')"
        )


class HookCall:
    """The graph's call target: holds hook and state, which FX cannot write as arguments."""

    def __init__(self, hook: TraceableCommHook, state: Any) -> None:
        self.hook, self.state = hook, state
        self.__name__ = self.__qualname__ = "traceable_comm_hook_sync"

    def __call__(self, index: int, last: bool, carry: bool, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return HookSync.apply(self, index, last, carry, *tensors)


class HookSync(torch.autograd.Function):
    """Identity in the forward; a traceable hook on the bucket in the backward."""

    @staticmethod
    def forward(
        ctx: Any, call: HookCall, index: int, last: bool, carry: bool, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.call, ctx.index, ctx.last = call, index, last
        ctx.carry = tensors[0] if carry else None
        params = tensors[1:] if carry else tensors
        ctx.shapes = [(p.shape, p.dtype, p.device) for p in params]
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        full = filled_grads(grads, ctx.shapes)
        flat = torch.cat([g.reshape(-1) for g in full])
        if ctx.carry is not None:
            flat = ctx.carry + flat
        out = cc.wait(ctx.call.hook.fn(ctx.call.state, GraphBucket(flat, full, ctx.index, ctx.last)))
        if not isinstance(out, torch.Tensor) or out.numel() != flat.numel() or out.dtype != flat.dtype:
            got = f"{tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else type(out).__name__
            raise TypeError(
                f"comm hook {ctx.call.hook.__qualname__} must return the reduced bucket as a tensor of "
                f"{flat.numel()} {flat.dtype} elements, got {got}"
            )
        return (None, None, None, None, *([None] if ctx.carry is not None else []), *split_like(out.reshape(-1), full))


class TracedHookProgram(HookProgram):
    """A :class:`TraceableCommHook`: no host state; variants only for accumulated gradients."""

    def __init__(self, hook: TraceableCommHook, state: Any, spec: CommSpec) -> None:
        super().__init__()
        self.call = HookCall(hook, state)
        self.name = hook.__qualname__
        self._spec = spec

    def plain_spec(self) -> CommSpec:
        return self._spec

    def variant(self, graph: HookedGraph) -> Hashable:
        return ("hook", has_grads(graph.buckets))

    def input_specs(self, variant: Hashable, graph: HookedGraph) -> list[InputSpec]:
        if not variant[1]:
            return []
        return [bucket_input_spec(b, sum(p.tensor.numel() for p in b)) for b in graph.buckets]

    def inputs(self, variant: Hashable, graph: HookedGraph) -> list[torch.Tensor]:
        return [take_grads(b) for b in graph.buckets] if variant[1] else []

    def insert(self, gm, buckets, variant, extra) -> None:
        last = len(buckets) - 1
        keys = [self.key(b) for b in buckets]

        def args(i: int) -> tuple[Any, ...]:
            return (keys[i], i == last, bool(variant[1]), *([extra[i]] if variant[1] else []))

        insert_bucket_syncs(gm, buckets, self._spec, target=self.call, bucket_args=args)

    def variant_name(self, variant: Hashable) -> str:
        return self.name + (" (accumulated gradients)" if variant[1] else "")

    def wire(self, bucket):
        """Bytes measured by one run of the hook on fake tensors (its side effects run again)."""
        numel = sum(p.tensor.numel() for p in bucket)
        first = bucket[0].tensor

        def run(fake_mode: Any) -> None:
            flat = torch.empty(numel, dtype=first.dtype, device=first.device)
            like = [torch.empty(p.tensor.shape, dtype=first.dtype, device=first.device) for p in bucket]
            cc.wait(self.call.hook.fn(self.call.state, GraphBucket(flat, like, self.key(bucket), False)))

        return f"traced hook {self.name}", cc.collective_input_bytes(run), None

    def describe(self) -> str:
        return f"traceable comm hook {self.name}"
