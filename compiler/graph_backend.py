"""The backend bucketwise hands to ``torch.compile``: one call per Dynamo graph.

For each graph, in this order: find the DDP parameters it reads, pick the strategy, plan
buckets, transform and compile (``split``: cut and compile segments; ``fused``: insert bucket
allreduces and compile whole; ``none``: compile whole), record the stats.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import time
import weakref
from typing import Any, Callable, Sequence

import torch.fx as fx

from .._compat import collectives as cc
from .._compat import ddp as ddpc
from ..distributed.cache_keys import comm_pass_key, traced_call_targets
from ..distributed.ddp_optimizer import plan_for_graph, split_and_compile
from ..distributed.embedding_rows import insert_embedding_rows, plan_embedding_rows, renormed_tables
from ..distributed.comm_hooks import HookedGraph, HookProgram, TracedHookProgram, comm_hook_kind
from ..distributed.fused import CommSpec, backward_positions, insert_bucket_syncs
from ..distributed.fused_policy import why_not_fused
from ..distributed.powersgd_run import PowerSGDRun
from ..distributed.plan import BucketCaps, plan_buckets
from ..distributed.rank_check import check_same_on_all_ranks, gather_on_all_ranks
from ..distributed.ready_order import FirstIterationOrder, ReadyLast
from ..partitioners.param_usage import GraphParam, find_graph_params, higher_order_ops, ready_order
from ..partitioners.split import Segment
from .._compat import dynamo as dc
from . import doctor
from ..cudagraphs import policy as cudagraph_policy
from ..stats.compile_times import backend_call_times
from .config import CompileConfig
from ..cudagraphs.runner import CudaGraphGroup, inner_compile_factory
from .hook_variants import VariantCompiler
from .progress import Progress
from ..stats.report import BucketStats, GraphStats, Report, SegmentStats, VariantStats
from .segments import CompileOutcome, compile_with_fallback

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Result:
    fn: Callable[..., Any]
    segments: list[Segment]
    outcomes: list[CompileOutcome]
    buckets: list[BucketStats]
    plan_source: str | None = None
    comm_hook: str | None = None
    variants: list[VariantStats] = dataclasses.field(default_factory=list)


class GraphBackend:
    """Plans, transforms and compiles every graph Dynamo captures for one compiled object.

    ``ddp``: the DDP module whose gradients are at stake (``None`` for plain modules and
    functions; a function that calls a DDP module is detected at compile time).
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
        self._checked_layouts: set[tuple[str, ...]] = set()
        self._sparse_noted: set[str] = set()
        self.cudagraphs = self._cudagraph_group(cudagraphs)
        self._label = "graph ?"
        self._segment_no = 0
        self._rank_check_s = 0.0
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
        self._rank_check_s = 0.0
        graph_id = len(self.report.graphs)
        self._label, self._segment_no = f"graph {graph_id}", 0
        cid = dc.current_compile_id()
        progress = Progress(f"graph {graph_id}")
        ddp = self._resolve_ddp()
        strategy, why = self._strategy_for(ddp)
        params = self._graph_params(gm, example_inputs, ddp)
        op_count, hops = _op_count(gm), higher_order_ops(gm)
        break_reason = dc.graph_break_reason(gm)
        recompile_reason = dc.recompile_reason()

        handler = {"split": self._split, "fused": self._fused, "none": self._whole}[strategy]
        diagnosed_gm = copy.deepcopy(gm) if doctor.enabled() and strategy != "split" else None
        result = handler(gm, example_inputs, ddp, params, progress)
        if diagnosed_gm is not None and len(result.segments) == 1:
            # split graphs are diagnosed per segment (compile_segments)
            result.fn = doctor.Diagnosed(result.fn, diagnosed_gm, f"graph {graph_id} segment 0", self.config.backend_name)

        times = backend_call_times(time.perf_counter() - start, result.outcomes, self._rank_check_s)
        self.report.compile_times.track(times, dc.current_compile_id_text(), call_us)
        self._record(graph_id, cid, strategy, why, params, result, op_count, hops, break_reason, recompile_reason, times)
        fn = result.fn
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
                self.report.note(f"{p.name}: sparse gradient, reduced on its own as DDP reduces it (outside the buckets)")
        return dense

    # -- strategy choice -------------------------------------------------------------------

    def _resolve_ddp(self) -> Any | None:
        ddp = self.ddp
        if ddp is None and dc.active_ddp_module() is not None:
            # A compiled function calling a DDP module: that module's reducer owns the grads.
            ddp = dc.active_ddp_module()
            self._ddp = weakref.ref(ddp)
        return ddp

    def _strategy_for(self, ddp: Any | None) -> tuple[str, str | None]:
        requested = self.config.strategy
        if requested == "none":
            return "none", ("no_sync(): no gradient communication" if self.variant == "no_sync" else None)
        if ddp is None:
            return "none", ("no DDP module: no gradient buckets" if requested in ("split", "fused") else None)
        if ddpc.uses_python_reducer(ddp):
            return "none", "DDP's python reducer (compiled autograd) does its own bucketing"
        if requested == "split":
            return "split", None
        # "fused" or "auto"
        blocker = why_not_fused(ddp, requested)
        if blocker is not None:
            return "split", blocker
        if self.fused_runtime is None:
            return "split", "fused needs bucketwise to run the DDP forward: compile the DDP module itself"
        return "fused", None

    # -- strategies ------------------------------------------------------------------------

    def _caps(self, ddp: Any) -> BucketCaps:
        return BucketCaps.from_ddp(
            ddp, bucket_cap_mb=self.config.bucket_cap_mb, first_bucket_cap_mb=self.config.first_bucket_cap_mb
        )

    def _split(self, gm, example_inputs, ddp, params, progress) -> _Result:
        # A parameter an earlier graph also reads (used on both sides of a graph break) gets
        # its gradient completed by that earlier graph's backward: plan it there only.
        frame = _frame_key(dc.current_compile_id(), len(self.report.graphs))
        earlier = {n for key, names in self.param_segments.items() if key < frame for n in names}
        params = [p for p in params if p.name not in earlier]
        caps = self._caps(ddp)
        if not caps.matches_ddp(ddp):
            self.report.note(
                f"bucket caps {caps.limits()} differ from the DDP module's own: its reducer keeps "
                "its buckets, so they will not coincide with the segments (see alignment)"
            )
        buckets, source = plan_for_graph(ddp, params, caps)
        try:
            result = split_and_compile(
                gm,
                example_inputs,
                params,
                buckets,
                self._compile_whole,
                self.segment_backend,
                backend_name=self.config.backend_name,
                fallback=self.config.fallback,
                progress=progress,
            )
        except Exception as exc:
            if self.config.fallback == "raise" or dc.functorch_depth() or dc.is_dynamo_control_flow(exc):
                raise
            # Splitting itself failed (an op torch.fx's splitter cannot carry across a cut):
            # compile the graph whole; DDP's reducer still reduces it, after its backward.
            log.warning("bucketwise: could not split graph, compiling it whole: %s", exc)
            self.report.note(f"a graph could not be split and was compiled whole: {type(exc).__name__}: {exc}"[:300])
            return self._whole(gm, example_inputs, ddp, params, progress)
        seg_of = {p.name: seg.index for seg in result.segments for p in seg.params}
        stats = [_bucket_stats(i, b, None, None, seg_of) for i, b in enumerate(buckets)]
        return _Result(result.compiled, result.segments, result.outcomes, stats, source)

    def _fused(self, gm, example_inputs, ddp, params, progress) -> _Result:
        spec = _comm_spec(ddp)
        program = self._hook_program(ddp, spec)
        if program is not None:
            return self._fused_hook(gm, example_inputs, ddp, params, progress, program)
        buckets, tables = self._fused_plan(gm, ddp, params, spec)
        # What each collective reduces, for the report: buckets, then the gathered tables (a
        # table's gather is issued after the gradient of its first use, its first lookup).
        reduced = [(b, "all_reduce", _wire_bytes(b, spec), None) for b in buckets] + [
            ([t.param], "all_gather rows", t.wire_bytes(spec.comm_dtype), None) for t in tables
        ]
        positions = backward_positions(gm, [group for group, *_ in reduced])
        # Rows first: each lookup is replaced in place (node positions unchanged), so the
        # buckets' first-use positions still hold for insert_bucket_syncs.
        insert_embedding_rows(gm, tables, spec)
        insert_bucket_syncs(gm, buckets, spec)
        what = "whole graph + %d bucket allreduces" % len(buckets) + (" + %d row gathers" % len(tables) if tables else "")
        with progress.step(what, self.config.backend_name):
            compiled, outcome = compile_with_fallback(
                gm,
                example_inputs,
                self._fused_compiler(),
                backend_name=self.config.backend_name,
                fallback=self.config.fallback,
            )
        return self._fused_result(gm, params, spec, reduced, positions, compiled, outcome)

    def _fused_result(self, gm, params, spec, reduced, positions, compiled, outcome, **extra) -> _Result:
        key = self.fused_runtime.graphs_compiled((id(p.tensor) for group, *_ in reduced for p in group), spec)
        compiled = _FusedRan(compiled, self.fused_runtime, key)
        used = [p for p in params if p.first_use >= 0]
        segment = Segment(index=0, submodule="", params=used, op_count=_op_count(gm))
        seg_of = {p.name: 0 for p in used}
        stats = [
            _bucket_stats(i, group, pos, spec.describe(), seg_of, collective, wire, parts)
            for i, ((group, collective, wire, parts), pos) in enumerate(zip(reduced, positions))
        ]
        return _Result(compiled, [segment], [outcome], stats, "predicted", **extra)

    # -- comm hooks in the graph (distributed/comm_hooks.py) --------------------------------

    def _hook_program(self, ddp: Any, spec: CommSpec) -> HookProgram | None:
        """The program of the DDP module's comm hook, shared by its graphs; ``None`` for torch's
        allreduce/fp16/bf16 hooks and no hook (plain ``BucketSync``)."""
        runtime = self.fused_runtime
        kind, _ = comm_hook_kind(ddp)
        if kind not in ("powersgd", "traceable"):
            return None
        if runtime.hook is None:
            hook, state = ddpc.comm_hook(ddp)
            if kind == "powersgd":
                runtime.hook = PowerSGDRun(state, _group_spec(state.process_group), dc.mark_static_address)
            else:
                runtime.hook = TracedHookProgram(hook, state, spec)
        return runtime.hook

    def _fused_hook(self, gm, example_inputs, ddp, params, progress, program: HookProgram) -> _Result:
        """A graph whose buckets a comm hook reduces: compiled per variant (HookedGraph), from
        copies of ``gm``, which stays as Dynamo gave it. No embedding rows: the hook gets tables
        like any gradient, as in eager DDP."""
        spec = program.plain_spec()
        buckets, _ = self._fused_plan(gm, ddp, params, spec, rows=False)
        synced = [[p for p in b if p.first_use >= 0] for b in buckets]
        synced = [b for b in synced if b]
        reduced = [(b, *program.wire(b)) for b in synced]
        positions = backward_positions(gm, synced)
        compiler = VariantCompiler(gm, example_inputs, program, synced, self._compile_variant, self.report, self._label)
        graph = HookedGraph(program, synced, compiler)
        # Equal results with eager DDP need the reducer's buckets (NOTE [powersgd in the graph]).
        if not ddpc.will_rebuild(ddp):
            self.report.note(f"{program.name}: DDP keeps its construction-time buckets (find_unused_parameters=True), "
                             "the fused graphs reduce the planned ones: the hook sees other buckets than in eager DDP")
        elif program.bucket_count() > len(synced):
            self.report.note(f"{program.name}: several graphs reduce buckets, each its own: the hook sees other "
                             "buckets (and indices) than DDP's reducer would give it in eager DDP")
        with progress.step(f"whole graph + {len(synced)} buckets ({program.describe()})", self.config.backend_name):
            graph.ensure(program.variant(graph))
        return self._fused_result(gm, params, spec, reduced, positions, graph, compiler.first_outcome(),
                                  comm_hook=program.describe(), variants=compiler.variants)

    def _compile_variant(self, gm: fx.GraphModule, example_inputs: list[Any], label: str) -> tuple[Callable[..., Any], CompileOutcome]:
        """A comm hook's variant of a graph (``label`` names its CUDA-graph runners)."""
        with self._labelled(label):
            return compile_with_fallback(gm, example_inputs, self._fused_compiler(),
                                         backend_name=self.config.backend_name, fallback=self.config.fallback)

    @contextlib.contextmanager
    def _labelled(self, label: str):
        """CUDA-graph runners compiled meanwhile are named after ``label``."""
        saved = self._label, self._segment_no
        self._label, self._segment_no = label, 0
        try:
            yield
        finally:
            self._label, self._segment_no = saved

    def _fused_plan(self, gm, ddp, params, spec, rows: bool = True) -> tuple[list[list[GraphParam]], list[Any]]:
        """Buckets to all-reduce and embedding tables to gather as rows (``rows``), agreed on by
        all ranks."""
        caps = self._caps(ddp)
        renormed = renormed_tables(gm, params)
        if renormed:
            log.info("bucketwise fused: %s reduced after the backward: max_norm renormalises it in place",
                     ", ".join(p.name for p in renormed))
            params = [p for p in params if p not in renormed]
        dense = plan_buckets(ready_order(params), caps)
        # Tables reduced as gathered rows (NOTE [embedding rows]) leave the buckets.
        tables = plan_embedding_rows(gm, params, spec.world_size) if rows and self.config.gather_embedding_rows else []
        gathered = {t.param.reducer_index for t in tables}
        buckets = plan_buckets(ready_order([p for p in params if p.reducer_index not in gathered]), caps) if tables else dense
        # NOTE [fused layout check]: a fused graph's collectives line up with the other ranks'
        # only if they run graphs with the same bucket layout. A layout already checked across
        # ranks is safe wherever it shows up again (the same frame recompiled for a new shape on
        # one rank, the other side of a data-dependent branch compiled a few steps later), so it
        # is not checked again. A new layout is checked with one collective on a gloo side group:
        # ranks that compile it together compare it; a rank that compiles it alone (a recompile
        # on one rank that changes which parameters the graph reads) times out and raises
        # RankMismatchError naming the failed guard, instead of hanging in a mismatched allreduce.
        # Ranks that compile together but look up different numbers of ids (uneven batches)
        # all fall back to all-reducing the tables.
        layout = tuple(_layout_signature(buckets, spec) + [t.signature(spec) for t in tables])
        if layout in self._checked_layouts:
            return buckets, tables
        dense_layout = tuple(_layout_signature(dense, spec))
        context = _compile_context(recompile_reason=dc.recompile_reason(), graphs=len(self.report.graphs))
        if tables:
            context += (f"; this graph gathers embedding gradients as rows ({tables[0].signature(spec)}), which "
                        "needs every rank to look up as many ids: pass gather_embedding_rows=False otherwise")
        pg = ddpc.process_group(ddp)
        check_start = time.perf_counter()
        everyone = gather_on_all_ranks((layout, dense_layout), pg, what="fused bucket layout", context=context)
        self._rank_check_s += time.perf_counter() - check_start
        if all(theirs[0] == layout for theirs in everyone):
            self._checked_layouts.add(layout)
            return buckets, tables
        if any(theirs[0] != theirs[1] for theirs in everyone):
            log.warning("bucketwise fused: ranks look up different numbers of ids in graph %d; its embedding "
                        "tables are all-reduced whole", len(self.report.graphs))
        check_same_on_all_ranks(dense_layout, pg, what="fused bucket layout", gathered=[t[1] for t in everyone],
                                fix=_LAYOUT_FIX)
        self._checked_layouts.add(dense_layout)
        return dense, []

    def _whole(self, gm, example_inputs, ddp, params, progress) -> _Result:
        with progress.step("whole graph", self.config.backend_name):
            compiled, outcome = self._compile_whole(gm, example_inputs)
        used = [p for p in params if p.first_use >= 0]
        segment = Segment(index=0, submodule="", params=used, op_count=_op_count(gm))
        return _Result(compiled, [segment], [outcome], [])

    def _compile_whole(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[Callable[..., Any], CompileOutcome]:
        return compile_with_fallback(
            gm, example_inputs, self.segment_backend, backend_name=self.config.backend_name, fallback=self.config.fallback
        )

    def _fused_compiler(self) -> Callable[..., Any]:
        """The backend, with Inductor's comm/compute reordering on (scoped to its compiles)."""
        if self._fused_backend is None:
            if self.config.backend == "inductor":
                options = {**cc.comm_overlap_options(comm_pass_key()), **(self.config.options or {})}
                self._fused_backend = self._make_backend(dc.cacheable_calls_options(traced_call_targets(), options))
            else:
                self._fused_backend = self.segment_backend
        return self._fused_backend

    # -- stats -----------------------------------------------------------------------------

    def _record(
        self, graph_id, cid, strategy, why, params, result: _Result, op_count, hops, break_reason, recompile_reason, times
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
                strategy=strategy,
                strategy_reason=why,
                graph_break_reasons=[break_reason] if break_reason else [],
                recompile=recompile,
                recompile_reason=recompile_reason if recompile else None,
                op_count=op_count,
                higher_order_ops=hops,
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


class _FusedRan:
    """A fused graph that tells the runtime it ran (see NOTE [fused strategy runtime])."""

    def __init__(self, fn: Callable[..., Any], runtime: Any, key: int) -> None:
        self.fn, self.runtime, self.key = fn, runtime, key

    def __call__(self, *args: Any) -> Any:
        self.runtime.graph_ran(self.key)
        return self.fn(*args)


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


def _op_count(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op.startswith("call_"))


def _bucket_stats(index, bucket, issued_at, comm_dtype, seg_of, collective=None, wire_bytes=None, wire_parts=None) -> BucketStats:
    segs = sorted({seg_of[p.name] for p in bucket if p.name in seg_of})
    return BucketStats(
        index=index,
        params=[p.name for p in bucket],
        bytes=sum(p.nbytes for p in bucket),
        segment=segs[0] if len(segs) == 1 else None,
        issued_at=issued_at,
        comm_dtype=comm_dtype,
        collective=collective,
        wire_bytes=wire_bytes,
        wire_parts=wire_parts,
    )


def _wire_bytes(bucket: Sequence[GraphParam], spec: CommSpec) -> int:
    if spec.comm_dtype is None:
        return sum(p.nbytes for p in bucket)
    return sum(p.tensor.numel() for p in bucket) * spec.comm_dtype.itemsize


def _comm_spec(ddp: Any) -> CommSpec:
    kind, _ = comm_hook_kind(ddp)
    dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(kind)
    import torch

    spec = _group_spec(ddpc.process_group(ddp))
    return dataclasses.replace(spec, comm_dtype=getattr(torch, dtype) if dtype else None, divide_first=kind != "reducer")


def _group_spec(pg: Any) -> CommSpec:
    """torch's ``allreduce_hook`` on ``pg`` (the default group when ``None``): divide, then sum."""
    import torch.distributed as dist

    pg = pg if pg is not None else dist.group.WORLD
    return CommSpec(group=cc.group_name(pg), world_size=cc.world_size(pg), divide_first=True)


_LAYOUT_FIX = (
    "strategy='fused' needs every rank's graph to read the same parameters; where ranks use different "
    "parameters (find_unused_parameters=True, rank-dependent control flow) use strategy='split' or 'auto', "
    "where DDP's reducer reduces"
)


def _compile_context(*, recompile_reason: str | None, graphs: int) -> str:
    if recompile_reason:
        return f"this rank is recompiling (guard failed: {recompile_reason[:200]})"
    return f"this rank is compiling its graph number {graphs}"


def _layout_signature(buckets: Sequence[Sequence[GraphParam]], spec: CommSpec) -> list[str]:
    return [
        f"bucket {i}: {len(b)} params, {sum(p.tensor.numel() for p in b)} elements, "
        f"{b[0].dtype}, {spec.describe()}, [{b[0].name} .. {b[-1].name}]"
        for i, b in enumerate(buckets)
    ]


def _forward_positions(gm: fx.GraphModule, params: Sequence[GraphParam]) -> list[int]:
    """Flat argument index of each placeholder parameter, in forward first-use order."""
    index = {node: i for i, node in enumerate(gm.graph.find_nodes(op="placeholder"))}
    used = sorted((p for p in params if p.first_use >= 0 and p.node in index), key=lambda p: (p.first_use, p.arg_position))
    return [index[p.node] for p in used]
