"""bucketwise's own CUDA-graph wrapper for compiled graphs (``cudagraphs=True``).

One :class:`CudaGraphRunner` wraps one Inductor-compiled graph (the forward, the backward or the
inference graph of a segment) and replays it from a ``torch.cuda.CUDAGraph``; the runners of one
compiled object share a :class:`CudaGraphGroup` (one capture stream, one set of stats; each
recording has a memory pool of its own, NOTE [one pool per recording]). A replay is one launch
and a few pointer checks: no cudagraph trees.

NOTE [cudagraph replay safety]: a replay writes into the same output memory every time. The
runner therefore

- clones the outputs a forward returns to autograd/the user (cheap: activations saved for the
  backward are not among them) and every output of an inference graph;
- hands out the other outputs (saved activations, gradients) without a copy, and before the
  next replay checks that nobody still holds their memory (tensor and storage use counts);
  if someone does (two forwards before their backwards, gradients kept across steps), that
  call runs uncaptured instead of overwriting them;
- hands a backward's gradients out as fresh aliases of its static outputs (``detach()``), so
  autograd's AccumulateGrad *steals* each one into ``param.grad`` instead of cloning it (it
  clones a tensor somebody else references, and the runner keeps the static ones: one copy
  kernel per parameter per step). A stolen gradient that is kept
  (``no_sync()`` micro-steps after ``zero_grad(set_to_none=True)``) makes the next backward
  run uncaptured; the runner then stops lending and hands out the static tensors themselves,
  which AccumulateGrad copies, instead of running uncaptured again;
- uses parameters, buffers and outputs of other runners of its group in place (their address
  is checked each call, a moved one runs uncaptured, then re-records), and copies every other
  tensor input into a static buffer;
- runs a new input signature once uncaptured (the warm-up) and records on its second call,
  at most ``max_records`` times; past that it runs uncaptured and the stats say why.

The first call of a signature and every fallback call run the compiled graph itself, so a
failed or refused capture never changes numerics.

NOTE [one pool per recording]: graphs captured into one shared pool may place their outputs in
memory that an earlier-captured graph uses as scratch while it replays. That is safe only when
the graphs replay in the order they were captured and every output is dead before that earlier
graph replays again; neither holds here. A graph whose first signature changes once (a backward
whose incoming gradient has other strides on the first step) records a step after the rest;
gradients kept over ``no_sync()`` micro-steps and saved activations of a second forward live
across other graphs' replays. On a T5 and a Whisper model (one H100, ``fused``) a shared pool
gave wrong gradients from the third step: a backward recorded last put a parameter's gradient
in the scratch of the backwards replayed after it. Each recording therefore captures into a
pool of its own: its scratch is reused only by its own replays, and the outputs a runner
protects (NOTE [cudagraph replay safety]) are written by no other graph. The price is the
scratch of every recording held at once instead of the largest one.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from typing import Any, Callable, Sequence

import torch

from .._compat import dynamo as dc
from ..distributed import teardown

log = logging.getLogger(__name__)

MAX_RECORDS = 8
"""Recordings per runner (input signatures, moved parameters) before it stays uncaptured."""

_HELD = "outputs of the previous replay still in use (kept gradients or a second forward before the backward)"

_RELEASE_WAIT_S = 5.0
"""How long a release waits for in-flight replays to finish (NOTE [cuda graphs at teardown])."""

_MOVED_BEFORE_RERECORD = 2
"""Consecutive calls with a moved static input before the runner records again."""


@dataclasses.dataclass
class CudaGraphStats:
    """One wrapped graph: a segment's forward, backward or inference graph."""

    name: str
    captured: bool = False
    """At least one recording is live and replaying."""
    reason: str | None = None
    """Why it does not replay from a CUDA graph (``None`` while it does or may)."""
    replays: int = 0
    records: int = 0
    warmups: int = 0
    uncaptured_runs: int = 0
    """Calls after the warm-up that ran uncaptured (reasons counted in ``uncaptured_reasons``)."""
    uncaptured_reasons: dict[str, int] = dataclasses.field(default_factory=dict)
    pool_bytes: int = 0
    """Bytes this graph's recordings added to the group's memory pool."""
    inputs_in_place: int = 0
    """Latest recording: tensor inputs read in place (parameters, buffers, other graphs' outputs)."""
    inputs_copied: int = 0
    """Latest recording: tensor inputs copied into a static buffer on every replay."""

    def ran_uncaptured(self, why: str) -> None:
        self.uncaptured_runs += 1
        self.uncaptured_reasons[why] = self.uncaptured_reasons.get(why, 0) + 1

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class CudaGraphs:
    """The CUDA side of capture and replay (a test on CPU passes an emulation instead)."""

    device_type = "cuda"

    def __init__(self) -> None:
        self._stream = None

    def capture(self, fn: Callable[[list[Any]], Any], inputs: Sequence[Any]) -> tuple[Any, Any]:
        """Record ``fn(list(inputs))`` into a new graph with a memory pool of its own (NOTE [one
        pool per recording]); returns (graph, fn's result). Nothing runs: the first replay
        computes. The graph keeps no reference to ``inputs``, only their addresses."""
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        # thread_local: NCCL's watchdog and other threads keep querying events meanwhile.
        with torch.cuda.graph(graph, pool=None, stream=self._stream, capture_error_mode="thread_local"):
            out = fn(list(inputs))
        return graph, out

    def replay(self, graph: Any, inputs: Sequence[Any]) -> None:
        """Replay ``graph``; ``inputs`` are the tensors at the recorded addresses right now
        (a real graph reads the addresses; an emulation reads the tensors)."""
        graph.replay()

    def reserved_bytes(self) -> int:
        return torch.cuda.memory_reserved()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the work queued so far on the current stream (replays and
        the NCCL kernels they hold) to finish; False if it has not (a collective waiting for a
        rank that is gone never does: no unbounded ``synchronize()`` at exit)."""
        done = torch.cuda.Event()
        done.record()
        deadline = time.monotonic() + timeout_s
        while not done.query():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True


class CudaGraphGroup:
    """The runners of one compiled object: capture stream, stats, stable addresses."""

    def __init__(
        self,
        on_stats: Callable[[CudaGraphStats], None],
        graphs: CudaGraphs | None = None,
        *,
        max_records: int = MAX_RECORDS,
    ) -> None:
        self.graphs = graphs if graphs is not None else CudaGraphs()
        self.on_stats = on_stats
        self.max_records = max_records
        # data_ptr of every tensor at a fixed address a runner may use in place: static inputs
        # of forwards (parameters, buffers) and the static outputs of every recording.
        self.stable_ptrs: set[int] = set()
        # Held weakly: a runner lives as long as the compiled graph that calls it (Dynamo's
        # cache), so torch._dynamo.reset() still frees its recordings.
        self._runners: "weakref.WeakSet[CudaGraphRunner]" = weakref.WeakSet()
        teardown.on_teardown(self.release)

    def release(self, reason: str) -> None:
        """Destroy every recording now (NOTE [cuda graphs at teardown]); the runners run their
        compiled graphs uncaptured from then on."""
        live = [r for r in self._runners if r.records]
        if not live:
            return
        if not self.graphs.wait_idle(_RELEASE_WAIT_S):
            # An interrupted step: a replayed collective still waits for another rank. Leave the
            # recordings to the process's end (NCCL aborts instead of waiting for them then).
            log.warning(
                "bucketwise: GPU work still running after %.0f s at %s (a collective waiting for a rank "
                "that stopped?); %d CUDA graph recording(s) left in place",
                _RELEASE_WAIT_S,
                reason,
                len(live),
            )
            return
        for r in live:
            r.release(reason)
        log.info("bucketwise: released %d CUDA graph recording(s) at %s", len(live), reason)

    def runner(
        self,
        compiled: Callable[[list[Any]], Any],
        *,
        name: str,
        static_input_idxs: Sequence[int],
        mutated_inputs: dict[int, str],
        returned_outputs: int | None,
        blockers: Sequence[str],
    ) -> "CudaGraphRunner":
        stats = CudaGraphStats(name=name, reason="; ".join(blockers) if blockers else None)
        self.on_stats(stats)
        runner = CudaGraphRunner(
            compiled,
            self,
            stats,
            static_input_idxs=static_input_idxs,
            mutated_inputs=mutated_inputs,
            returned_outputs=returned_outputs,
            blocked=bool(blockers),
        )
        self._runners.add(runner)
        return runner


@dataclasses.dataclass
class _Recording:
    graph: Any
    inputs: list[Any]  # the copy buffers at copy_idxs (None elsewhere: no reference is kept to
    # tensors read in place, their owners' use counts stay exact, see NOTE [cudagraph replay safety])
    copy_idxs: list[int]  # inputs copied into inputs[i] on every call
    stable_idxs: list[int]  # inputs used in place; their address is checked on every call
    stable_ptrs: list[int]
    outputs: list[Any]
    clone_idxs: list[int]
    held_idxs: list[int]  # outputs lent out (or handed out as is): checked free before the next replay
    held_use: list[int]
    held_storage: list[tuple[int, int]]  # distinct (storage cdata, use count) at record time


class CudaGraphRunner:
    """One compiled graph replayed from CUDA graphs (boxed calling convention, like Inductor's).

    ``returned_outputs``: how many leading outputs go back to autograd/the user and are cloned
    after each replay (``None``: all of them, an inference graph).
    """

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
        # An instance attribute: torch wraps the backward in torch._dynamo.disable, whose
        # functools.wraps copies the instance __dict__ (a class attribute would be lost).
        self._boxed_call = True
        self.compiled = compiled
        self.group = group
        self.stats = stats
        self.static_input_idxs = frozenset(static_input_idxs)
        self.mutated_inputs = dict(mutated_inputs)
        self.returned_outputs = returned_outputs
        self.disabled = blocked
        self.records: dict[tuple, _Recording] = {}
        self.warmed: set[tuple] = set()
        self._moved_calls = 0
        self.lend = returned_outputs == 0
        """A backward: hand out its gradients as aliases (see NOTE [cudagraph replay safety])."""

    def __call__(self, args: list[Any]) -> Any:
        if self.disabled:
            return self.compiled(args)
        key = _signature(args)
        rec = self.records.get(key)
        if rec is None:
            if key not in self.warmed:
                self.warmed.add(key)
                self.stats.warmups += 1
                return self.compiled(args)
            return self._record(key, args)
        why = self._why_not_replay(rec, args)
        if why is not None:
            if why == "moved":
                self._moved_calls += 1
                if self._moved_calls >= _MOVED_BEFORE_RERECORD:
                    del self.records[key]
                    return self._record(key, args)
                why = "a parameter or saved input moved since the recording"
            elif why == _HELD and self.lend:
                # Someone keeps a lent output across calls (accumulated gradients): stop lending.
                self.lend = False
                log.info(
                    "bucketwise: %s: outputs kept across calls; handing out the static outputs from now on",
                    self.stats.name,
                )
            self.stats.ran_uncaptured(why)
            return self.compiled(args)
        self._moved_calls = 0
        return self._replay(rec, args)

    # -- replay ------------------------------------------------------------------------------

    def _why_not_replay(self, rec: _Recording, args: list[Any]) -> str | None:
        for i, ptr in zip(rec.stable_idxs, rec.stable_ptrs):
            if args[i].data_ptr() != ptr:
                return "moved"
        outs = rec.outputs
        for i, use in zip(rec.held_idxs, rec.held_use):
            if dc.tensor_use_count(outs[i]) > use:
                return _HELD
        for cdata, use in rec.held_storage:
            if dc.storage_use_count(cdata) > use:
                return _HELD
        return None

    def _replay(self, rec: _Recording, args: list[Any]) -> list[Any]:
        for i in rec.copy_idxs:
            rec.inputs[i].copy_(args[i])
            args[i] = rec.inputs[i]
        self.group.graphs.replay(rec.graph, args)
        args.clear()
        self.stats.replays += 1
        out = list(rec.outputs)
        for i in rec.clone_idxs:
            out[i] = out[i].clone()
        if self.lend:
            for i in rec.held_idxs:
                out[i] = out[i].detach()
        return out

    # -- record ------------------------------------------------------------------------------

    def _record(self, key: tuple, args: list[Any]) -> list[Any]:
        if self.stats.records >= self.group.max_records:
            self._disable(
                f"recorded {self.stats.records} times (new input shapes or moved parameters); runs uncaptured"
            )
            return self.compiled(args)
        try:
            rec = self._capture(args)
        except Exception as exc:  # a refused capture: run uncaptured from now on, numerics unchanged
            log.warning("bucketwise: CUDA-graph capture of %s failed, running uncaptured: %s", self.stats.name, exc)
            self._disable(f"capture failed: {type(exc).__name__}: {exc}"[:300])
            return self.compiled(args)
        if rec is None:
            return self.compiled(args)
        self.records[key] = rec
        self.stats.records += 1
        self.stats.inputs_in_place, self.stats.inputs_copied = len(rec.stable_idxs), len(rec.copy_idxs)
        self.stats.captured = True
        self._moved_calls = 0
        return self._replay(rec, args)

    def release(self, reason: str) -> None:
        self._disable(f"released at {reason}: runs uncaptured")

    def _disable(self, reason: str) -> None:
        self.disabled = True
        self.records.clear()
        self.stats.captured = False
        self.stats.reason = reason

    def _capture(self, args: list[Any]) -> _Recording | None:
        stable = self.group.stable_ptrs
        inputs: list[Any] = []
        copy_idxs, stable_idxs = [], []
        for i, a in enumerate(args):
            if not isinstance(a, torch.Tensor):
                inputs.append(a)
            elif i in self.static_input_idxs or a.data_ptr() in stable or dc.has_static_address(a):
                inputs.append(a)
                stable_idxs.append(i)
            elif i in self.mutated_inputs:
                self._disable(f"{self.mutated_inputs[i]} writes into input {i}, which is not a parameter or buffer")
                return None
            elif not _dense(a):
                self._disable(f"input {i} is not dense (strides {tuple(a.stride())}): cannot keep a static copy")
                return None
            else:
                buf = torch.empty_strided(a.size(), a.stride(), dtype=a.dtype, device=a.device)
                buf.copy_(a)
                inputs.append(buf)
                copy_idxs.append(i)
        before = self.group.graphs.reserved_bytes()
        graph, outputs = self.group.graphs.capture(self.compiled, inputs)
        self.stats.pool_bytes += max(0, self.group.graphs.reserved_bytes() - before)
        outputs = list(outputs)
        # An output may be a copy buffer itself (the forward saving its input for the backward):
        # it is protected like any other output.
        copy_ptrs = {inputs[i].untyped_storage().data_ptr() for i in copy_idxs}
        input_ptrs = {a.untyped_storage().data_ptr() for a in inputs if isinstance(a, torch.Tensor)}
        n_returned = len(outputs) if self.returned_outputs is None else self.returned_outputs
        clone_idxs, held_idxs = [], []
        for i, o in enumerate(outputs):
            if not isinstance(o, torch.Tensor):
                continue
            base = o.untyped_storage().data_ptr()
            if base in input_ptrs and base not in copy_ptrs:
                continue  # a parameter or buffer handed back: nothing to protect
            if i < n_returned:
                clone_idxs.append(i)
            else:
                held_idxs.append(i)
                stable.add(o.data_ptr())
        for i in stable_idxs:
            stable.add(inputs[i].data_ptr())
        kept = set(copy_idxs)
        return _Recording(
            graph=graph,
            inputs=[a if i in kept else None for i, a in enumerate(inputs)],
            copy_idxs=copy_idxs,
            stable_idxs=stable_idxs,
            stable_ptrs=[inputs[i].data_ptr() for i in stable_idxs],
            outputs=outputs,
            clone_idxs=clone_idxs,
            held_idxs=held_idxs,
            held_use=[dc.tensor_use_count(outputs[i]) for i in held_idxs],
            held_storage=[
                (c, dc.storage_use_count(c)) for c in dict.fromkeys(dc.storage_cdata(outputs[i]) for i in held_idxs)
            ],
        )


def _signature(args: Sequence[Any]) -> tuple:
    """What a recording depends on besides addresses: shapes, strides, dtypes, scalar values."""
    return tuple(
        (a.shape, a.stride(), a.dtype, a.device) if isinstance(a, torch.Tensor) else (type(a), a) for a in args
    )


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its memory exactly once in some order of its dimensions
    (a permuted contiguous tensor is; an expanded or strided-slice view is not): then a buffer
    from ``empty_strided`` with the same strides holds a copy of it."""
    if t.is_contiguous() or t.numel() == 0:
        return True
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def inner_compile_factory(
    group: CudaGraphGroup, label: Callable[[], str], *, auto: bool
) -> Callable[[], Callable[..., Any]]:
    """``make_inner`` for :func:`dc.compile_with_inner`: each graph handed to the
    backend gets an inner compile that compiles with Inductor and wraps the result in a runner
    named after ``label()`` (read once, when the backend is called)."""
    from .policy import capture_blockers, mutated_placeholders

    def make_inner() -> Callable[..., Any]:
        name = label()

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
    for a in example_inputs:
        if isinstance(a, torch.SymInt):
            return True
        if isinstance(a, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in a.shape):
            return True
    return False
