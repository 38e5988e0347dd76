"""DDP comm hooks other than torch's allreduce/fp16/bf16 ones, under the fused strategy.

NOTE [comm hooks in the graph]: a comm hook turns a bucket's gradients into its reduced
gradients, and ``fused`` reduces inside the compiled backward, so it reproduces there, bucket by
bucket, the hooks it can trace: ``allreduce_hook``, ``fp16_compress_hook`` and
``bf16_compress_hook`` (``fused.BucketSync``), ``powerSGD_hook`` with its ``PowerSGDState``
(NOTE [powersgd in the graph]) and a hook written with functional collectives and wrapped in
``bucketwise.traceable_comm_hook`` (``HookSync``). Any other hook (Python around
``dist.all_reduce`` futures, ``batched_powerSGD_hook``) cannot be traced: ``auto`` then compiles
with ``split``, DDP's reducer running the hook between compiled segments, and the report says
why. A hook with per-step host decisions or state is a :class:`HookProgram`, its graph a
:class:`HookedGraph` compiled once per variant the program asks for (a plain all-reduce, the
hook, the hook with accumulated gradients), with the extra inputs (state tensors, accumulated
gradients) after Dynamo's.
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
        """The bucket's index as the hook sees it (``GradBucket.index()``): buckets are numbered
        in the order graphs are compiled, each graph's in backward order; a recompiled graph
        with the same buckets gets the same numbers."""
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
        """Graph pass: the variant's syncs (``extra``: the placeholders of its extra inputs, in
        the order of ``input_specs``)."""
        raise NotImplementedError

    def variant_name(self, variant: Hashable) -> str:
        raise NotImplementedError

    def wire(self, bucket: Sequence[GraphParam]) -> tuple[str, int | None, dict[str, int] | None]:
        """For the report: the bucket's collective(s), the bytes each rank sends per step once the
        hook runs (``None``: unknown), and those bytes per collective (``None``: one)."""
        raise NotImplementedError

    def describe(self) -> str:
        return self.name

    def after_synced_forward(self) -> None:
        """Once per synced step, after every graph's forward."""


class HookedGraph:
    """One Dynamo graph under a :class:`HookProgram`: compiled once per variant, the variant
    picked at each call (see NOTE [powersgd in the graph] for why variants, not recompiles)."""

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
    """The bucket's gradients as one flat buffer, zeros where there is none; the parameters'
    ``.grad`` are cleared: the backward adds them to the new gradients before the hook
    (NOTE [powersgd in the graph], accumulated gradients)."""
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
    """A DDP comm hook the fused strategy traces into the compiled backward (see
    :func:`traceable_comm_hook`). Registered with ``ddp.register_comm_hook(state, hook)``."""

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

    ``fn(state, bucket)`` returns the reduced bucket as one flat tensor (as many elements and
    the dtype of ``bucket.buffer()``), computed with functional collectives
    (``torch.distributed._functional_collectives``: ``all_reduce``, ``all_gather_tensor``,
    ``reduce_scatter_tensor``, ...), not with ``dist.all_reduce`` and futures. Register the
    result like any hook: ``ddp.register_comm_hook(state, traceable_comm_hook(fn))``. Eager DDP
    and ``split`` call ``fn`` on DDP's ``GradBucket``; ``fused`` traces it once per bucket and
    graph variant with a bucket offering ``buffer()``, ``gradients()``, ``index()`` and
    ``is_last()`` (last bucket of its graph), so host-side effects in ``fn`` (counters, logging,
    reading tensors with ``.item()``) happen when it is traced, not at every step."""
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
    """The graph's call target for a traceable hook: the hook and its state, which FX keeps as
    a global of the generated code (they cannot be written as arguments)."""

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
        """The bytes the hook hands to functional collectives, from one run of it on fake tensors
        (a host-side effect of the hook happens once more here)."""
        numel = sum(p.tensor.numel() for p in bucket)
        first = bucket[0].tensor

        def run(fake_mode: Any) -> None:
            flat = torch.empty(numel, dtype=first.dtype, device=first.device)
            like = [torch.empty(p.tensor.shape, dtype=first.dtype, device=first.device) for p in bucket]
            cc.wait(self.call.hook.fn(self.call.state, GraphBucket(flat, like, self.key(bucket), False)))

        return f"traced hook {self.name}", cc.collective_input_bytes(run), None

    def describe(self) -> str:
        return f"traceable comm hook {self.name}"
