"""The state a compiled object keeps between calls, and the per-call protocol
(:meth:`CompiledState.run`) compiled modules and functions share."""

from __future__ import annotations

import dataclasses
import enum
import logging
import types
import weakref
from typing import Any, Callable

import torch

from .._compat import dynamo as dc
from ..cudagraphs.policy import Decision as CudaGraphDecision
from ..stats import profiling
from ..stats.first_step import FirstStep
from ..stats.report import Report
from .artifacts import Artifacts
from .blocks.calls import BlockCalls
from .config import CompileConfig
from .decision import Variant
from .graph_backend import GraphBackend

log = logging.getLogger(__name__)

_STANCES = {"raise": "fail_on_recompile", "eager": "eager_on_recompile"}


class Phase(enum.Enum):
    NEW = "new"
    """Not called yet: a DDP module's strategy is decided at its first call."""
    WARM = "warm"
    """Called at least once (``freeze=`` freezes here)."""


@dataclasses.dataclass(eq=False, kw_only=True)
class CompiledState:
    """Everything one object returned by :func:`bucketwise.compile` keeps between calls."""

    config: CompileConfig
    report: Report
    backend: GraphBackend
    call: Callable[..., Any]
    """The ``torch.compile``'d frame: the module's own frame (``module._inner_forward``) or the
    function."""
    code: types.CodeType | None
    """That frame's code object (a module's own copy: NOTE [one cache per compiled object])."""
    module: Any = None
    """The compiled module (``None`` for a function)."""
    cudagraphs: CudaGraphDecision | None = None
    """Whether its graphs get bucketwise's CUDA graphs (resolved once, ``api.resolve_cudagraphs``)."""
    phase: Phase = Phase.NEW
    frozen: str | None = None
    """``"raise"``/``"eager"`` once frozen (:func:`bucketwise.freeze`), else ``None``."""
    ddp: Any = None
    """``ddp_forward.DDPForward`` for a compiled DDP module, else ``None``."""
    first_call: Any = None
    """``torch.compile(ddp, backend="bucketwise")``: the first call's frames to forget
    (``dynamo_backend._FirstCall``)."""
    artifacts: Artifacts | None = None
    """Where this rank's compiled artifacts are kept (NOTE [compile artifacts]), else ``None``."""
    breaks: dc.BreakCount = dataclasses.field(default_factory=dc.BreakCount)
    """Dynamo's graph-break count, read around each call (:func:`say_breaks`)."""

    def run(self, owner: Any, call: Callable[[], Any], *, training: bool) -> Any:
        report = self.report
        if self.artifacts is not None and self.phase is Phase.WARM and not self.artifacts.decided:
            self._save_artifacts()
        profiling.on_call(owner, report, training=training)
        runs = report.graph_runs
        first = report.first_step
        pending = first.pending
        if pending:
            first.start()
        self.breaks.start()
        try:
            out = call()
        except BaseException:
            if pending:  # the first step is the first call that runs (NOTE [first step])
                report.first_step = FirstStep()
            raise
        if pending:
            first.forward_done(out)
        breaks = self.breaks.new()
        if breaks:
            say_breaks(report, breaks)
        if report.graph_runs == runs:
            say_eager(report, self.code, self.frozen)
        if self.phase is Phase.NEW:
            self.phase = Phase.WARM
            if self.config.freeze_mode is not None and self.frozen is None:
                self.freeze(self.config.freeze_mode)
        report.after_call()
        return out

    def load_artifacts(self) -> None:
        """See NOTE [compile artifacts]."""
        if self.artifacts is not None:
            self.report.note(self.artifacts.load())

    def _save_artifacts(self) -> None:
        """After the first step (NOTE [compile artifacts])."""
        self.artifacts.decided = True
        times = self.report.totals["compile_times"]
        misses = sum(times.get(cache, {}).get("miss", 0) for cache in ("fx_graph_cache", "aot_autograd_cache"))
        if self.artifacts.should_save(misses):
            self.report.note(self.artifacts.save())

    # A copy or pickle of the module does not carry the compile along.
    def __deepcopy__(self, memo: dict) -> None:
        return None

    def __reduce__(self) -> Any:
        return (_nothing, ())

    def freeze(self, on_recompile: str) -> None:
        self.frozen = on_recompile
        self.report.note(f"frozen: a recompile {'raises' if on_recompile == 'raise' else 'runs eagerly'}")

    def stance(self) -> Any:
        """The scope a call of the compiled frame runs in (a no-op unless frozen)."""
        if self.frozen is None:
            return _NULL
        return torch.compiler.set_stance(_STANCES[self.frozen])


def _nothing() -> None:
    return None


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_NULL = _Null()


def new_backend(
    config: CompileConfig,
    report: Report,
    ddp: Any | None,
    *,
    cudagraphs: CudaGraphDecision,
    variant: Variant = Variant.SYNC,
    alignment: bool = True,
    decisions: Any = None,
    module: torch.nn.Module | None = None,
    blocks_of: torch.nn.Module | None = None,
    block_calls: BlockCalls | None = None,
) -> GraphBackend:
    """A graph backend recording into ``report`` (``alignment``: the report reads it from this
    one); ``decisions``: see ``GraphBackend``; ``blocks_of`` or ``block_calls`` (shared with
    another backend): the shared blocks."""
    backend = GraphBackend(
        config,
        report,
        ddp,
        cudagraphs=cudagraphs,
        variant=variant,
        decisions=decisions,
        module=module,
        blocks_of=blocks_of,
        block_calls=block_calls,
    )
    if alignment:
        report.set_alignment_source(backend.alignment)
    return backend


def torch_compile(fn: Callable[..., Any], backend: GraphBackend, config: CompileConfig) -> Callable[..., Any]:
    """``torch.compile(fn)`` with ``backend``, held weakly (NOTE [a compiled object lets go])."""
    return torch.compile(fn, backend=WeakBackend(backend), fullgraph=config.fullgraph, dynamic=config.dynamic)


class WeakBackend:
    """What ``torch.compile`` gets as the backend: a weak reference to a :class:`GraphBackend`.

    NOTE [a compiled object lets go]: torch keeps every backend in a process-wide table until
    ``torch._dynamo.reset()``, and compiled graphs live as module globals until their cache
    entries go; either would keep the model alive. So the table holds this weak object, and when
    the compiled object is collected its finalizer forgets every frame it compiled
    (``dc.forget_compiled``), freeing the model at ``gc.collect()``.
    """

    def __init__(self, backend: GraphBackend) -> None:
        self._backend = weakref.ref(backend)
        self.__name__ = "bucketwise"

    def __call__(self, gm: Any, example_inputs: Any) -> Any:
        backend = self._backend()
        if backend is None:
            raise RuntimeError("bucketwise: the compiled object this graph belongs to is gone")
        return backend(gm, example_inputs)


def say_breaks(report: Report, breaks: Any) -> None:
    """Graph breaks Dynamo met in this call that no graph names: say each reason once.

    The report lists a break with the graph it ended. A break before any torch operation of its
    frame (a logging call opening a layer's forward) or in a loop ends none, one in a with/try
    block ends the graph named for the block: unsaid, the code around them would be compiled
    apart or run eagerly without a word."""
    listed = [r for g in report.graphs for r in g.graph_break_reasons]
    for message in breaks:
        # By message, not count: Dynamo counts some breaks twice (2.13: a disabled function's).
        text = " ".join(message.split())
        if any(r.startswith(text) for r in listed):
            continue
        first = message.strip().splitlines()[0] if message.strip() else "no message"
        note = (
            f"Dynamo met a graph break that no graph of the report names ({first}): a break before any "
            "torch operation of its frame, inside a loop (Dynamo then skips the frame) or inside a with or try "
            "block (the frame runs eagerly from that block on) ends no graph of its own; the code around it is "
            "compiled apart or runs eagerly (TORCH_LOGS=graph_breaks shows where)"
        )
        if note not in report.notes:
            log.info("bucketwise: %s: %s", report.target, note)
            report.note(note)


def say_eager(report: Report, code: Any, frozen: str | None) -> None:
    """A call ran none of its compiled graphs: report it, and warn once per reason."""
    # NOTE [never silently eager]: Dynamo runs frames eagerly almost silently (recompile limit,
    # skipped frame, suppressed error). Every graph we hand back counts its runs
    # (graph_backend._Counted), so such a call is seen here and the report and a warning say so.
    limit = dc.recompile_limit()
    if frozen == "eager":
        reason = "frozen with on_recompile='eager' and a guard failed (a new input shape?)"
    elif code is not None and dc.cache_entries(code) >= limit:
        reason = (
            f"Dynamo's recompile limit ({limit} compiled versions of this frame) is reached; a call that "
            "needs another runs eagerly (TORCH_LOGS=recompiles names the guard; mark the changing dimension "
            "dynamic, or raise torch._dynamo.config.recompile_limit)"
        )
    else:
        reason = "Dynamo produced no graph for this call (the frame was skipped, or every op broke the graph)"
    if report.ran_eagerly(reason):
        log.warning("bucketwise: %s ran eagerly: %s", report.target, reason)
