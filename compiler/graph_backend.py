"""The backend bucketwise hands to ``torch.compile``: one call per Dynamo graph.

For each graph, in this order: find the DDP parameters it reads, resolve the strategy
(``strategy.resolve_strategy``), apply it (``apply_split``, ``apply_fused`` or ``apply_whole``,
each handed this backend's way to compile a graph), record the stats, and wrap what Dynamo
will call (gradient-ready order for the reducer, the delayed allreduce trigger, run counting).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
import weakref
from typing import Any, Callable, Iterator, Sequence

import torch.fx as fx

from .._compat import ddp as ddpc
from .._compat import dynamo as dc
from ..cudagraphs import policy as cudagraph_policy
from ..cudagraphs.runner import CudaGraphGroup, inner_compile_factory
from ..distributed.fused import FusedState, apply_fused, fused_backend_options
from ..distributed.plan import BucketCaps
from ..distributed.result import CompileOutcome, StrategyResult, op_count
from ..distributed.split import apply_split
from ..distributed.split.ready_order import FirstIterationOrder, ReadyLast
from ..distributed.whole import apply_whole
from ..partitioners.param_usage import GraphParam, find_graph_params, higher_order_ops
from ..stats.compile_times import CompileTimes, backend_call_times
from ..stats.report import GraphStats, Report, SegmentStats
from . import doctor
from .config import CompileConfig
from .progress import Progress
from .segments import compile_with_fallback
from .strategy import StrategyChoice, resolve_strategy

log = logging.getLogger(__name__)


class GraphBackend:
    """Plans, transforms and compiles every graph Dynamo captures for one compiled object.

    ``ddp``: the DDP module whose gradients are at stake (``None`` for plain modules and
    functions; a function that calls a DDP module is detected at compile time).
    ``cudagraphs``: the compiled object's CUDA-graph decision (resolved once, ``api``).
    ``fused_runtime``: present when bucketwise owns the DDP forward and may keep the reducer
    idle, which the fused strategy needs.
    """

    def __init__(
        self,
        config: CompileConfig,
        report: Report,
        ddp: Any | None,
        *,
        cudagraphs: cudagraph_policy.Decision,
        fused_runtime: Any | None = None,
        variant: str | None = None,
    ) -> None:
        self.config = config
        self.report = report
        self.variant = variant
        self.fused_runtime = fused_runtime
        self._ddp = weakref.ref(ddp) if ddp is not None else None
        self._fused: FusedState | None = None
        self._sparse_noted: set[str] = set()
        self.cudagraphs = self._cudagraph_group(cudagraphs)
        self._label = "graph ?"
        self._segment_no = 0
        self.segment_backend = self._make_backend(config.options)
        self._fused_backend: Callable[..., Any] | None = None
        # Frame -> param name -> segment index (latest compile of each frame): alignment.
        # Frames are numbered in the order Dynamo first meets them, i.e. forward order.
        self.param_segments: dict[int, dict[str, int]] = {}

    def _cudagraph_group(self, decision: cudagraph_policy.Decision) -> CudaGraphGroup | None:
        """The runners' group of this backend where ``decision`` (resolved once per compiled
        object) enables CUDA graphs (a test seam: tests pass an emulated group)."""
        if decision.reason and self.config.cudagraphs is not False:
            self.report.note(f"cudagraphs={self.config.cudagraphs!r} not applied: {decision.reason}")
        return CudaGraphGroup(self.report.add_cudagraph) if decision.enabled else None

    def _make_backend(self, options: dict | None) -> Callable[..., Any]:
        """The backend segments and graphs are compiled with: the user's, or Inductor with every
        compiled graph wrapped in a CUDA-graph runner (``cudagraphs``)."""
        cfg = self.config
        if self.cudagraphs is None:
            return dc.make_backend(cfg.backend, cfg.mode, options, cfg.dynamic)
        make_inner = inner_compile_factory(self.cudagraphs, self._next_label, auto=cfg.cudagraphs == "auto")
        return dc.compile_with_inner(cfg.mode, options, cfg.dynamic, make_inner)

    def _next_label(self) -> str:
        label = f"{self._label} segment {self._segment_no}"
        self._segment_no += 1
        return label if self.variant is None else f"{label} ({self.variant})"

    @property
    def ddp(self) -> Any | None:
        return self._ddp() if self._ddp is not None else None

    # torch.compile calls backend(gm, example_inputs)
    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        start, call_us = time.perf_counter(), dc.wall_us()
        # Earlier graphs' records first: later compiles push them out of torch's short list.
        self.report.compile_times.refresh()
        graph_id = len(self.report.graphs)
        self._label, self._segment_no = f"graph {graph_id}", 0
        cid = dc.current_compile_id()
        ddp = self._resolve_ddp()
        choice = resolve_strategy(
            self.config.strategy, ddp, runs_ddp_forward=self.fused_runtime is not None, variant=self.variant
        )
        params = self._graph_params(gm, example_inputs, ddp)
        seen = {
            "op_count": op_count(gm),
            "higher_order_ops": higher_order_ops(gm),
            "break_reason": dc.graph_break_reason(gm),
            "recompile_reason": dc.recompile_reason(),
        }
        diagnosed_gm = copy.deepcopy(gm) if doctor.enabled() and choice.strategy != "split" else None
        result = self._apply(choice.strategy, gm, example_inputs, ddp, params, Progress(f"graph {graph_id}"), graph_id)
        if diagnosed_gm is not None and len(result.segments) == 1:
            # split graphs are diagnosed per segment (compile_segments)
            result.fn = doctor.Diagnosed(
                result.fn, diagnosed_gm, f"graph {graph_id} segment 0", self.config.backend_name
            )
        for text in result.notes:
            self.report.note(text)
        times = backend_call_times(time.perf_counter() - start, result.outcomes, result.rank_check_s)
        self.report.compile_times.track(times, dc.current_compile_id_text(), call_us)
        self._record(graph_id=graph_id, cid=cid, choice=choice, params=params, result=result, times=times, **seen)
        return self._wrap(result.fn, gm, example_inputs, ddp, params, choice.strategy)

    def _apply(
        self,
        strategy: str,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        ddp: Any | None,
        params: list[GraphParam],
        progress: Progress,
        graph_id: int,
    ) -> StrategyResult:
        piece = self._piece_compiler(progress, self.segment_backend)
        if strategy == "split":
            frame = _frame_key(dc.current_compile_id(), graph_id)
            earlier = {n for key, names in self.param_segments.items() if key < frame for n in names}
            return apply_split(
                gm=gm,
                example_inputs=example_inputs,
                ddp=ddp,
                params=params,
                earlier_names=earlier,
                caps=self._caps(ddp),
                compile_piece=piece,
                fallback=self.config.fallback,
            )
        if strategy == "fused":
            if self._fused is None:
                self._fused = FusedState(runtime=self.fused_runtime)
            self._fused.rank_check_s = 0.0
            return apply_fused(
                gm=gm,
                example_inputs=example_inputs,
                ddp=ddp,
                params=params,
                caps=self._caps(ddp),
                gather_rows=self.config.gather_embedding_rows,
                state=self._fused,
                graph_id=graph_id,
                compile_graph=self._piece_compiler(progress, self._fused_compiler()),
                compile_variant=self._compile_variant,
                progress_step=lambda what: progress.step(what, self.config.backend_name),
                on_later_variant=self.report.write_rank_file,
            )
        return apply_whole(gm=gm, example_inputs=example_inputs, params=params, compile_piece=piece)

    def _wrap(
        self,
        fn: Callable[..., Any],
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        ddp: Any | None,
        params: list[GraphParam],
        strategy: str,
    ) -> Callable[..., Any]:
        """What Dynamo calls: the reducer's gradient-ready order (not under ``fused``, whose
        reducer is idle), the delayed allreduce's trigger last, every run counted."""
        if ddp is not None and params and strategy != "fused":
            fn = FirstIterationOrder(fn, ddp, _forward_positions(gm, params))
        trigger = ddpc.delayed_allreduce_trigger(ddp) if ddp is not None else None
        if trigger is not None:
            positions = [i for i, a in enumerate(example_inputs) if a is trigger]
            fn = ReadyLast(fn, positions) if positions else fn
        return _Counted(fn, self.report)

    def _graph_params(self, gm: fx.GraphModule, example_inputs: Sequence[Any], ddp: Any | None) -> list[GraphParam]:
        """The reducer parameters this graph reads, but those DDP gives a sparse gradient
        (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``): DDP reduces each of
        those on its own as a sparse tensor, and so do they stay here, outside every bucket
        (DDP's reducer under ``split``/``none``, the fused runtime under ``fused``)."""
        if ddp is None:
            return []
        named = ddpc.reducer_parameters(ddp)
        params = find_graph_params(gm, example_inputs, named)
        sparse = {id(p) for (_, p), flag in zip(named, ddpc.sparse_gradient_flags(ddp)) if flag}
        dense = [p for p in params if id(p.tensor) not in sparse]
        for p in params:
            if id(p.tensor) in sparse and p.name not in self._sparse_noted:
                self._sparse_noted.add(p.name)
                self.report.note(
                    f"{p.name}: sparse gradient, reduced on its own as DDP reduces it (outside the buckets)"
                )
        return dense

    def _resolve_ddp(self) -> Any | None:
        ddp = self.ddp
        if ddp is None and dc.active_ddp_module() is not None:
            # A compiled function calling a DDP module: that module's reducer owns the grads.
            ddp = dc.active_ddp_module()
            self._ddp = weakref.ref(ddp)
        return ddp

    def _caps(self, ddp: Any) -> BucketCaps:
        return BucketCaps.from_ddp(
            ddp, bucket_cap_mb=self.config.bucket_cap_mb, first_bucket_cap_mb=self.config.first_bucket_cap_mb
        )

    # -- compiling a graph or a segment -------------------------------------------------------

    def _piece_compiler(self, progress: Progress, backend_fn: Callable[..., Any]):
        """The ``CompilePiece`` the strategies compile with: ``backend_fn``, the fallback policy,
        a progress line each, the doctor on every segment of a split graph."""
        cfg = self.config

        def compile_piece(
            gm: fx.GraphModule, example_inputs: Sequence[Any], *, what: str, segment: int = 0, tracing: Any = None
        ) -> tuple[Callable[..., Any], CompileOutcome]:
            with progress.step(what, cfg.backend_name):
                compiled, outcome = compile_with_fallback(
                    gm,
                    example_inputs,
                    backend_fn,
                    backend_name=cfg.backend_name,
                    fallback=cfg.fallback,
                    tracing=tracing,
                )
            if tracing is not None and doctor.enabled():
                compiled = doctor.Diagnosed(compiled, gm, f"{progress.label} segment {segment}", cfg.backend_name)
            return compiled, outcome

        return compile_piece

    def _compile_variant(
        self, gm: fx.GraphModule, example_inputs: list[Any], label: str
    ) -> tuple[Callable[..., Any], CompileOutcome]:
        """A comm hook's variant of a graph (``label`` names its CUDA-graph runners)."""
        with self._labelled(label):
            return compile_with_fallback(
                gm,
                example_inputs,
                self._fused_compiler(),
                backend_name=self.config.backend_name,
                fallback=self.config.fallback,
            )

    @contextlib.contextmanager
    def _labelled(self, label: str) -> Iterator[None]:
        """CUDA-graph runners compiled meanwhile are named after ``label``."""
        saved = self._label, self._segment_no
        self._label, self._segment_no = label, 0
        try:
            yield
        finally:
            self._label, self._segment_no = saved

    def _fused_compiler(self) -> Callable[..., Any]:
        """The backend, with Inductor's comm/compute reordering on (scoped to its compiles)."""
        if self._fused_backend is None:
            if self.config.backend == "inductor":
                self._fused_backend = self._make_backend(fused_backend_options(self.config.options))
            else:
                self._fused_backend = self.segment_backend
        return self._fused_backend

    # -- stats -----------------------------------------------------------------------------

    def _record(
        self,
        *,
        graph_id: int,
        cid: dc.CompileId,
        choice: StrategyChoice,
        params: list[GraphParam],
        result: StrategyResult,
        times: CompileTimes,
        op_count: int,
        higher_order_ops: list[str],
        break_reason: str | None,
        recompile_reason: str | None,
    ) -> None:
        frame = _frame_key(cid, graph_id)
        # A recompile: this backend compiles a frame it compiled before (a guard failed). The
        # no_sync variant's first compile of a frame is not one, though Dynamo counts it.
        recompile = frame in self.param_segments
        self.param_segments[frame] = {p.name: seg.index for seg in result.segments for p in seg.params}
        segments = [
            SegmentStats(
                index=seg.index,
                params=[p.name for p in seg.params],
                bytes=sum(p.nbytes for p in seg.params),
                op_count=seg.op_count,
                compile_seconds=round(out.seconds, 6),
                backend=out.backend if not out.fell_back else "eager",
                fell_back=out.fell_back,
                reason=out.reason,
                phases=out.phases,
            )
            for seg, out in zip(result.segments, result.outcomes)
        ]
        self.report.add_graph(
            GraphStats(
                graph_id=graph_id,
                compile_id=str(cid),
                strategy=choice.strategy,
                strategy_reason=choice.reason,
                graph_break_reasons=[break_reason] if break_reason else [],
                recompile=recompile,
                recompile_reason=recompile_reason if recompile else None,
                op_count=op_count,
                higher_order_ops=higher_order_ops,
                segments=segments,
                buckets=result.buckets,
                unused_params=sorted(p.name for p in params if p.first_use < 0),
                plan_source=result.plan_source,
                variant=self.variant,
                compile_times=times,
                comm_hook=result.comm_hook,
                variants=result.variants,
            )
        )


class _Counted:
    """Every graph handed back to Dynamo: counts its runs in the report, so a call of the
    compiled object that ran none of them is known (NOTE [never silently eager])."""

    def __init__(self, fn: Callable[..., Any], report: Report) -> None:
        self.fn, self.report = fn, report

    def __call__(self, *args: Any) -> Any:
        self.report.graph_runs += 1
        return self.fn(*args)


def _frame_key(cid: dc.CompileId, graph_id: int) -> int:
    """Dynamo's frame id (recompiles of a frame share it); the graph id when unknown."""
    return cid.frame_id if cid.frame_id is not None else 10**6 + graph_id


def _forward_positions(gm: fx.GraphModule, params: Sequence[GraphParam]) -> list[int]:
    """Flat argument index of each placeholder parameter, in forward first-use order."""
    index = {node: i for i, node in enumerate(gm.graph.find_nodes(op="placeholder"))}
    used = sorted(
        (p for p in params if p.first_use >= 0 and p.node in index), key=lambda p: (p.first_use, p.arg_position)
    )
    return [index[p.node] for p in used]
