"""``cudagraphs=True``: a :class:`CudaGraphRunner` replays one Inductor graph in one launch and a few
pointer checks (no cudagraph trees); one compiled object's runners share a :class:`CudaGraphGroup`.

NOTE [cudagraph replay safety]: a replay rewrites the same output memory, so the runner never
replays over memory someone still holds; a call it does not replay runs the compiled graph itself.
Saved activations, gradients and large outputs for autograd or the user go out uncopied, their use
counts checked before the next replay that writes there (a backward in its forward's pool writes
where the forward's outputs were). An output for the user still held then (kept across steps, or
through the backward) makes that call run uncaptured, and its recording hands out clones from then
on, as it does from the start for small outputs (a loss) and for one that shares memory with
another (``recording.lendable``). Gradients go out as fresh ``detach()`` aliases so that
AccumulateGrad steals them (once one is kept, under ``no_sync()``, it copies the static tensors).
Parameters, buffers and other recordings' outputs are read in place (a moved one: uncaptured, then
re-recorded), other inputs copied into static buffers. A new signature runs once uncaptured from a
warm-up pool, dropped before any capture so each recording's pool starts empty, and records on its
second call, at most ``MAX_RECORDS`` times.

NOTE [a forward and its backward share a pool]: one pool per recording, except a backward recorded
while its forward's saved activations are that forward's capture outputs: it joins the forward's
pool, so it can free each activation as it reads it and reuse the memory, as eager autograd does.
That is safe only in a fixed replay order, so before a replay (else the call runs uncaptured) the
forward checks that its backward's gradients are no longer held, and the backward that only
autograd holds the activations it frees. A pool is shared once: a later backward gets its own.
The pool starts as one segment the size of what the forward's warm-up returned: the forward's
tensors then lie side by side, and the activations its backward frees merge into blocks a
gradient bucket fits in (in a segment each, a bucket larger than every activation took new memory).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import weakref
from typing import Any, Callable, Iterator, Sequence

import torch

from .._compat import dynamo as dc
from .._compat import storage as st
from ..distributed import teardown
from .cuda import CudaGraphs
from .recording import (
    CudaGraphStats,
    Plan,
    Recording,
    alias,
    let_go,
    plan_inputs,
    poison_held,
    refusal,
    signature,
)

log = logging.getLogger(__name__)

MAX_RECORDS = 8
"""Recordings per runner (input signatures, moved parameters) before it stays uncaptured."""

_HELD = "outputs of the previous replay still in use (kept gradients or a second forward before the backward)"
_MOVED = "a parameter or saved input moved since the recording"
_FORWARD_UNCAPTURED = (
    "saved activations not where its forward's replay put them "
    "(the forward ran uncaptured, or saved-tensor hooks moved them)"
)
_GRADIENTS_HELD = "gradients of its backward's previous replay still in use (the two share a memory pool)"
_RETAINED = "saved activations held beyond the backward (retain_graph=True?): they must not be overwritten"
_RETURNED_HELD = "outputs it returned at the previous replay still in use; returned as copies from now on"
_FORWARD_RETURNED_HELD = (
    "its forward's returned outputs still in use (the two share a memory pool); the forward returns copies from now on"
)

_RELEASE_WAIT_S = 5.0  # for replays in flight at a release (NOTE [cuda graphs at teardown])
_MOVED_BEFORE_RERECORD = 2  # consecutive calls with a moved static input before recording again


class CudaGraphGroup:
    """The runners of one compiled object: capture stream, stats, stable addresses."""

    def __init__(self, on_stats: Callable[[CudaGraphStats], None], graphs: CudaGraphs | None = None) -> None:
        self.graphs = graphs if graphs is not None else CudaGraphs()
        self.on_stats = on_stats
        # Addresses a runner may read in place: parameters, buffers, every recording's outputs.
        self.stable_ptrs: set[int] = set()
        # Forwards a backward may still join, by each saved activation's address
        # (NOTE [a forward and its backward share a pool]).
        self.open_forwards: "weakref.WeakValueDictionary[int, Recording]" = weakref.WeakValueDictionary()
        self._warm_pool: Any = None  # warm-ups allocate here until the next capture
        # Weakly: Dynamo's cache owns the runners, so torch._dynamo.reset() frees their recordings.
        self._runners: "weakref.WeakSet[CudaGraphRunner]" = weakref.WeakSet()
        teardown.on_teardown(self.release)

    def release(self, reason: str) -> None:
        """Destroy every recording now, the runners uncaptured from then on (NOTE [cuda graphs at teardown])."""
        live = [r for r in self._runners if r.records]
        if not live:
            return
        if not self.graphs.wait_idle(_RELEASE_WAIT_S):
            # A replayed collective waits for a rank that is gone: leave the recordings to NCCL's abort at exit.
            log.warning(
                "bucketwise: GPU work still running after %.0f s at %s (a collective waiting for a rank "
                "that stopped?); %d CUDA graph recording(s) left in place",
                _RELEASE_WAIT_S,
                reason,
                len(live),
            )
            return
        for r in live:
            r._disable(f"released at {reason}: runs uncaptured")
        self.open_forwards.clear()
        self._warm_pool = None
        log.info("bucketwise: released %d CUDA graph recording(s) at %s", len(live), reason)

    def warm_pool(self) -> Any:
        if self._warm_pool is None:
            # What the allocator keeps free (DDP's released bucket storage) goes back first: the
            # warm-up's segments come on top of what is in use, not of what is cached.
            self.graphs.release_cached()
            self._warm_pool = self.graphs.new_pool()
        return self._warm_pool

    def drop_warm_pool(self) -> None:
        """The warm-up pool goes, and every free segment with it (NOTE [cudagraph replay safety]):
        the next recording's pool starts on top of what is in use."""
        self._warm_pool = None
        self.graphs.release_cached()

    def runner(
        self, compiled: Callable[[list[Any]], Any], *, name: str, blockers: Sequence[str], **kwargs: Any
    ) -> "CudaGraphRunner":
        """A runner of ``compiled``; ``kwargs``: the rest of :class:`CudaGraphRunner`'s arguments."""
        stats = CudaGraphStats(name=name, reason="; ".join(blockers) if blockers else None)
        self.on_stats(stats)
        runner = CudaGraphRunner(compiled, self, stats, blocked=bool(blockers), **kwargs)
        self._runners.add(runner)
        return runner


class CudaGraphRunner:
    """One compiled graph replayed from CUDA graphs (boxed calling convention, like Inductor's).
    ``returned_outputs``: the leading outputs for autograd/the user, lent or cloned at each replay
    (``None``: all, an inference graph; ``0``: a backward)."""

    def __init__(
        self,
        compiled: Callable[[list[Any]], Any],
        group: CudaGraphGroup,
        stats: CudaGraphStats,
        *,
        static_input_idxs: Sequence[int],
        mutated_inputs: dict[int, str],
        returned_outputs: int | None,
        blocked: bool,
    ) -> None:
        # An instance attribute: torch wraps a backward in torch._dynamo.disable, which copies __dict__.
        self._boxed_call = True
        self.compiled = compiled
        self.group = group
        self.stats = stats
        self.static_input_idxs = frozenset(static_input_idxs)
        self.mutated_inputs = dict(mutated_inputs)
        self.returned_outputs = returned_outputs
        self.disabled = blocked
        self.records: dict[tuple, Recording] = {}
        self.warmed: set[tuple] = set()
        self.warm_bytes: dict[tuple, int] = {}  # what each signature's warm-up returned, for its pool
        self._moved_calls = 0
        self.lend = returned_outputs == 0  # a backward lends its gradients (NOTE [cudagraph replay safety])

    def __call__(self, args: list[Any]) -> Any:
        if self.disabled:
            return self.compiled(args)
        key = signature(args)
        rec = self.records.get(key)
        if rec is None:
            if key not in self.warmed:
                return self._warm_up(key, args)
            return self._record(key, args)
        why = self._why_not_replay(rec, args)
        if why is not None:
            if why == _MOVED:
                self._moved_calls += 1
                if self._moved_calls >= _MOVED_BEFORE_RERECORD:
                    del self.records[key]
                    return self._record(key, args)
            elif why == _HELD and self.lend:
                # A lent output is kept across calls (accumulated gradients): stop lending.
                self._stop_lending()
            elif why == _GRADIENTS_HELD and rec.backward is not None:
                rec.backward[0]._stop_lending()
            elif why == _RETURNED_HELD:
                self._return_copies(rec)
            elif why == _FORWARD_RETURNED_HELD and rec.forward is not None and (forward := rec.forward()) is not None:
                self._return_copies(forward)
            self.stats.ran_uncaptured(why)
            return self.compiled(args)
        self._moved_calls = 0
        return self._replay(rec, args)

    def _warm_up(self, key: tuple, args: list[Any]) -> Any:
        """The first call of a signature, uncaptured, in the group's warm-up pool."""
        self.warmed.add(key)
        self.stats.warmups += 1
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        with self.group.graphs.allocating_in(self.group.warm_pool()):
            out = self.compiled(args)
        if self.returned_outputs == 0:
            self.group.drop_warm_pool()
        else:
            storages = {
                o.untyped_storage().data_ptr(): o.untyped_storage().nbytes() for o in out if isinstance(o, torch.Tensor)
            }
            self.warm_bytes[key] = sum(n for ptr, n in storages.items() if ptr not in inputs)
        return out

    def _stop_lending(self) -> None:
        if self.lend:
            self.lend = False
            self.stats.note = "gradients kept across calls: copied out of the graph after every replay"
            log.info(
                "bucketwise: %s: outputs kept across calls; handing out the static outputs from now on",
                self.stats.name,
            )

    def _return_copies(self, rec: Recording) -> None:
        if rec.lent_idxs:
            rec.lent_idxs = frozenset()
            self.stats.note = (
                "a returned output was kept past a replay: the forward's outputs copied after every replay"
            )
            log.info("bucketwise: %s: %s", self.stats.name, self.stats.note)

    def _why_not_replay(self, rec: Recording, args: list[Any]) -> str | None:
        for i, ptr in zip(rec.stable_idxs, rec.stable_ptrs):
            now = args[i].data_ptr()
            if now != ptr:
                # A parameter moved or the forward re-recorded: record again. Activations at a
                # plain address: the forward ran uncaptured this once, so run uncaptured too.
                if i in rec.param_idxs or now in self.group.stable_ptrs:
                    return _MOVED
                return _FORWARD_UNCAPTURED
        if rec.held_elsewhere():
            return _HELD
        if rec.backward is not None and rec.backward[1].held_elsewhere():
            return _GRADIENTS_HELD
        for i, use, storage_use in rec.consumed:
            t = args[i]
            if st.tensor_use_count(t) > use or st.storage_use_count(st.storage_cdata(t)) > storage_use:
                return _RETAINED
        if rec.returned_held():
            return _RETURNED_HELD
        if rec.forward is not None and (forward := rec.forward()) is not None and forward.returned_held():
            return _FORWARD_RETURNED_HELD
        return None

    def _replay(self, rec: Recording, args: list[Any]) -> list[Any]:
        for i in rec.copy_idxs:
            rec.inputs[i].copy_(args[i])
            args[i] = rec.inputs[i]
        self.group.graphs.replay(rec.graph, args)
        args.clear()
        self.stats.replays += 1
        out = list(rec.outputs)
        for i in rec.clone_idxs:
            out[i] = out[i].detach() if i in rec.lent_idxs else out[i].clone()
        if self.lend:
            for i in rec.held_idxs:
                out[i] = out[i].detach()
        return out

    def _record(self, key: tuple, args: list[Any]) -> list[Any]:
        if self.stats.records >= MAX_RECORDS:
            self._disable(
                f"recorded {self.stats.records} times (new input shapes or moved parameters); runs uncaptured"
            )
            return self.compiled(args)
        refused = refusal(args, self.static_input_idxs, self.mutated_inputs, self.group.stable_ptrs)
        if refused is not None:
            self._disable(refused)
            return self.compiled(args)
        self.group.drop_warm_pool()
        forward = self._forward_to_join(args)
        pool = forward.pool if forward is not None else self.group.graphs.new_pool(self.warm_bytes.get(key, 0))
        # The forward's returned outputs, unless still in use, are free memory for the backward's
        # copy buffers (the loss's gradient has the logits' shape) and scratch; its replays check
        # them first. The buffers come before the forward lets go of its activations, so that none
        # sits where one lives.
        free = forward is not None and not forward.returned_held()
        returned = let_go(forward, forward.clone_idxs) if free else {}
        try:
            with self.group.graphs.allocating_in(pool):
                plan = plan_inputs(args, self.static_input_idxs, self.group.stable_ptrs)
            rec = self._record_plan(key, plan, args, forward, pool)
        finally:
            if forward is not None:
                alias(forward, returned)
        if returned:
            # Those outputs now live in memory the pool owns: one still in use when the forward's
            # recording goes (and its pool with it) raises on access instead of reading freed memory.
            outs = [(forward.outputs[i], st.storage_use_count(st.storage_cdata(forward.outputs[i]))) for i in returned]
            weakref.finalize(forward, poison_held, self.group.graphs.poison, outs).atexit = False
        if rec is None:
            return self.compiled(plan.call_args(forward))
        return self._replay(rec, plan.call_args(forward))

    def _record_plan(
        self, key: tuple, plan: Plan, args: list[Any], forward: "Recording | None", pool: Any
    ) -> Recording | None:
        """Capture ``plan`` (None: the capture failed, and this runner runs uncaptured)."""
        if forward is not None:
            mine = {id(forward.outputs[j]): j for j in forward.held_idxs}
            plan.consumed = {k: mine[id(args[k])] for k in plan.stable_idxs if id(args[k]) in mine}
        consumed = [
            (i, st.tensor_use_count(args[i]), st.storage_use_count(st.storage_cdata(args[i]))) for i in plan.consumed
        ]
        # Now only ``plan.inputs`` holds the consumed inputs: the capture frees each as it reads it.
        plan.hand_over()
        args.clear()
        before = self.group.graphs.reserved_bytes()
        try:
            rec = self._capture(plan, forward, pool)
        except Exception as exc:  # a refused capture: run uncaptured from now on, numerics unchanged
            log.warning("bucketwise: CUDA-graph capture of %s failed, running uncaptured: %s", self.stats.name, exc)
            self._disable(f"capture failed: {type(exc).__name__}: {exc}"[:300])
            return None
        self.stats.pool_bytes += max(0, self.group.graphs.reserved_bytes() - before)
        rec.consumed = consumed
        if forward is not None:
            forward.backward = (self, rec)
            rec.forward = weakref.ref(forward)
        elif self.returned_outputs not in (None, 0):
            for i in rec.held_idxs:
                self.group.open_forwards[rec.outputs[i].data_ptr()] = rec
        self.records[key] = rec
        self.stats.records += 1
        self.stats.inputs_in_place, self.stats.inputs_copied = len(rec.stable_idxs), len(rec.copy_idxs)
        self.stats.captured = True
        self._moved_calls = 0
        return rec

    def _disable(self, reason: str) -> None:
        self.disabled = True
        self.records.clear()
        self.stats.captured = False
        self.stats.reason = reason

    def _forward_to_join(self, args: list[Any]) -> "Recording | None":
        """A backward: the forward recording with a pool still open whose activations it reads."""
        if self.returned_outputs != 0:
            return None
        for a in args:
            forward = self.group.open_forwards.get(a.data_ptr()) if isinstance(a, torch.Tensor) else None
            if forward is not None and any(forward.outputs[j] is a for j in forward.held_idxs):
                return forward
        return None

    def _capture(self, plan: Plan, forward: "Recording | None", pool: Any) -> Recording:
        if forward is None:
            graph, outputs = self.group.graphs.capture(self.compiled, plan.inputs, pool=pool)
        else:
            for ptr in [p for p, r in self.group.open_forwards.items() if r is forward]:
                del self.group.open_forwards[ptr]
            saved = let_go(forward, forward.held_idxs)
            try:
                graph, outputs = self.group.graphs.capture(self.compiled, plan.inputs, pool=pool)
            finally:
                alias(forward, saved)
        outputs = list(outputs)
        n_returned = len(outputs) if self.returned_outputs is None else self.returned_outputs
        clone_idxs, held_idxs = [], []
        for i, o in enumerate(outputs):
            if not isinstance(o, torch.Tensor):
                continue
            base = o.untyped_storage().data_ptr()
            if base in plan.input_ptrs and base not in plan.copy_ptrs:
                continue  # a parameter or buffer handed back: nothing to protect
            if i < n_returned:
                clone_idxs.append(i)
            else:
                held_idxs.append(i)
                self.group.stable_ptrs.add(o.data_ptr())
        self.group.stable_ptrs.update(plan.stable_ptrs)
        return plan.recording(graph, pool, outputs, clone_idxs, held_idxs)


_LABEL: contextvars.ContextVar[str] = contextvars.ContextVar("bucketwise_cudagraph_label", default="graph")


@contextlib.contextmanager
def runner_label(label: str) -> Iterator[None]:
    """Names the runners compiled within the block (``graph 3 segment 0 forward``, ``... backward``)."""
    token = _LABEL.set(label)
    try:
        yield
    finally:
        _LABEL.reset(token)


def inner_compile_factory(group: CudaGraphGroup, *, auto: bool) -> Callable[[], Callable[..., Any]]:
    """``make_inner`` for :func:`dc.compile_with_inner`: Inductor's result in a runner."""
    from .policy import capture_blockers, mutated_placeholders

    def make_inner() -> Callable[..., Any]:
        name = _LABEL.get()

        def inner_compile(gm: Any, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
            # A backward's "static" inputs (Inductor's view) include saved activations, whose
            # address is stable only when the forward replayed: the runner finds those itself.
            static = [] if kwargs.get("is_backward") else list(kwargs.get("static_input_idxs") or ())
            blockers = capture_blockers(gm, example_inputs, device_type=group.graphs.device_type)
            mutated = mutated_placeholders(gm)
            if auto and _symbolic(example_inputs):
                blockers.append("auto: dynamic shapes")
            if kwargs.get("is_backward"):
                kind, returned = "backward", 0
            elif kwargs.get("is_inference"):
                kind, returned = "inference", None
            else:
                kind, returned = "forward", dc.forward_returned_outputs()
            compiled = dc.inductor_compile_inner(gm, example_inputs, **kwargs)
            return group.runner(
                compiled,
                name=f"{name} {kind}",
                static_input_idxs=static,
                mutated_inputs=mutated,
                returned_outputs=returned,
                blockers=blockers,
            )

        return inner_compile

    return make_inner


def _symbolic(example_inputs: Sequence[Any]) -> bool:
    shapes = (a.shape if isinstance(a, torch.Tensor) else (a,) for a in example_inputs)
    return any(isinstance(d, torch.SymInt) for shape in shapes for d in shape)
