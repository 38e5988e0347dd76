"""What one compiled object keeps between calls, and what every call of it does.

A compiled module (``module.py``) and a compiled function hold one :class:`CompiledState` each:
the config, the report, the graph backend and the ``torch.compile``'d frame, the phase, the
freeze mode and, for a DDP module, how its forward runs (``ddp_forward.DDPForward``).
:meth:`CompiledState.run` is the per-call protocol both share: profiling, the first step's
timing, the never-silently-eager check, freezing after the warm-up, the report's refresh.
"""

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

    def run(self, owner: Any, call: Callable[[], Any], *, training: bool) -> Any:
        """One call of the compiled object ``owner``: ``call()`` with the per-call protocol."""
        report = self.report
        if self.artifacts is not None and self.phase is Phase.WARM and not self.artifacts.decided:
            self._save_artifacts()
        profiling.on_call(owner, report, training=training)
        runs = report.graph_runs
        first = report.first_step
        pending = first.pending
        if pending:
            first.start()
        try:
            out = call()
        except BaseException:
            if pending:  # the first step is the first call that runs (NOTE [first step])
                report.first_step = FirstStep()
            raise
        if pending:
            first.forward_done(out)
        if report.graph_runs == runs:
            say_eager(report, self.code, self.frozen)
        if self.phase is Phase.NEW:
            self.phase = Phase.WARM
            if self.config.freeze_mode is not None and self.frozen is None:
                self.freeze(self.config.freeze_mode)
        report.after_call()
        return out

    def load_artifacts(self) -> None:
        """Fill the local compile caches from this rank's artifacts, if any (NOTE [compile artifacts])."""
        if self.artifacts is not None:
            self.report.note(self.artifacts.load())

    def _save_artifacts(self) -> None:
        """After the first step: save this rank's artifacts where they are new (NOTE [compile artifacts])."""
        self.artifacts.decided = True
        times = self.report.totals["compile_times"]
        misses = sum(times.get(cache, {}).get("miss", 0) for cache in ("fx_graph_cache", "aot_autograd_cache"))
        if self.artifacts.should_save(misses):
            self.report.note(self.artifacts.save())

    # The module a compiled object shares its state with records the compile (``set_owner``): a
    # copy or a pickle of that module does not carry it along (the copy is compiled anew).
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
    module: torch.nn.Module | None = None,
    blocks_of: torch.nn.Module | None = None,
    block_calls: BlockCalls | None = None,
) -> GraphBackend:
    """A graph backend recording into ``report``; with ``alignment`` (the backend whose graphs
    DDP's reducer reduces, when there is one) the report's alignment is read through it;
    ``module``: a plain module compiled without DDP, whose parameters the report counts;
    ``blocks_of``: the module whose blocks Dynamo meets as calls where blocks are shared, or
    ``block_calls``: those another backend of the same compiled object found."""
    backend = GraphBackend(
        config,
        report,
        ddp,
        cudagraphs=cudagraphs,
        variant=variant,
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

    NOTE [a compiled object lets go]: torch keeps every backend ``torch.compile`` was given in
    a process-wide table until ``torch._dynamo.reset()``, and Dynamo installs each compiled
    graph as a global of the compiled frame's module, removed when the frame's cache entries go.
    A backend holding the report and the DDP module, or a graph holding bucketwise's runtime,
    would then keep the model, its gradients and its compiled graphs alive after the user
    dropped them. So the table holds this small object, the compiled object holds the backend,
    and when the compiled object is collected every frame it compiled is forgotten
    (``CompiledModule``'s finalizer, ``dc.forget_compiled``), which removes those globals:
    dropping the compiled object and the model frees their memory at ``gc.collect()``.
    """

    def __init__(self, backend: GraphBackend) -> None:
        self._backend = weakref.ref(backend)
        self.__name__ = "bucketwise"

    def __call__(self, gm: Any, example_inputs: Any) -> Any:
        backend = self._backend()
        if backend is None:
            raise RuntimeError("bucketwise: the compiled object this graph belongs to is gone")
        return backend(gm, example_inputs)


def say_eager(report: Report, code: Any, frozen: str | None) -> None:
    """A call of a compiled object ran none of its compiled graphs: count it in the report and,
    the first time for a reason, log a warning (NOTE [never silently eager])."""
    # NOTE [never silently eager]: Dynamo runs a frame eagerly, without a word past one log line
    # of its own, when its recompile limit is hit, when a frame is skipped, when an error is
    # suppressed. Every graph bucketwise hands back counts its runs (graph_backend._Counted), so a
    # call that ran none is known here; the report's totals, table and note, the per-rank stats
    # (and so `bucketwise launch`/`stats`/`doctor`) and a warning say it, with the likely reason.
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
