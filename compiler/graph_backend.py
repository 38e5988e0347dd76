"""The backend bucketwise hands to ``torch.compile``: one call per Dynamo graph.

For each graph, in this order: find the DDP parameters it reads, build its plan from the DDP
module's decision and the graph's facts (``plan.plan_graph``, NOTE [one plan per graph]), share
its identical blocks where the plan says so, apply the plan's strategy (``APPLY``), record the
stats and the plan's reasons, and wrap what Dynamo will call (gradient-ready order for the
reducer, the delayed allreduce trigger, run counting).
"""

from __future__ import annotations

import copy
import logging
import time
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from .._compat import ddp as ddpc
from .._compat import dynamo as dc
from .._compat import inductor as ci
from ..cudagraphs import policy as cudagraph_policy
from ..cudagraphs.runner import CudaGraphGroup, inner_compile_factory
from ..distributed.fused import FusedState, fused_backend_options
from ..distributed.result import GraphJob, StrategyResult, op_count
from ..distributed.split.alignment import measure_alignment
from ..distributed.split.ready_order import FirstIterationOrder, ReadyLast
from ..partitioners.param_usage import GraphParam, ParamInput, higher_order_ops, match_params, params_in_graph
from ..stats.compile_times import CompileTimes, backend_call_times
from ..stats.report import GraphStats, Report, SegmentStats, eager_regions
from . import doctor
from .blocks import SHARED_BLOCK_BACKWARD
from .blocks import cache_targets as blocks_cache_targets
from .blocks.calls import BlockCalls, find_block_calls, repeated_blocks
from .blocks.graphs import grouping_pass
from .config import CompileConfig
from .decision import Decision, Strategy, Variant, decide, decide_sharing, refusal
from .graph_sharing import share_in_graph
from .plan import APPLY, GraphFacts, GraphPlan, plan_graph
from .progress import Progress
from .segments import SegmentCompiler

log = logging.getLogger(__name__)


class GraphBackend:
    """Plans, transforms and compiles every graph Dynamo captures for one compiled object.

    ``ddp``: the DDP module whose gradients are at stake (``None`` for plain modules and
    functions; a function that calls a DDP module is detected at compile time).
    ``cudagraphs``: the compiled object's CUDA-graph decision (resolved once, ``api``).
    ``variant``: ``Variant.NO_SYNC`` for the second cache of a compiled DDP module (no
    collectives). ``decisions``: where a compiled DDP module's decision and fused runtime are read
    (``DDPForward.current``); without it the backend decides when it first meets a DDP module
    (NOTE [one decision]).
    """

    def __init__(
        self,
        config: CompileConfig,
        report: Report,
        ddp: Any | None,
        *,
        cudagraphs: cudagraph_policy.Decision,
        variant: Variant = Variant.SYNC,
        decisions: Callable[[], tuple[Decision | None, FusedState | None]] | None = None,
        module: torch.nn.Module | None = None,
        blocks_of: torch.nn.Module | None = None,
        block_calls: BlockCalls | None = None,
    ) -> None:
        self.config = config
        self.report = report
        self.variant = variant
        self._decisions = decisions
        self._own: Decision | None = None
        """The decision this backend made itself for the DDP module a compiled function calls."""
        self._ddp = weakref.ref(ddp) if ddp is not None else None
        self._sparse_noted: set[str] = set()
        self._codes: weakref.WeakSet[Any] = weakref.WeakSet()
        self.cudagraphs = self._cudagraph_group(cudagraphs)
        # Whether any strategy may share blocks: Dynamo is to meet them as calls, and the
        # compiled graphs may call them (each graph's plan says whether they do).
        self._may_share = decide_sharing(config, cudagraphs=self.cudagraphs is not None).enabled
        self.segment_backend = self._make_backend(config.options)
        self._fused_backend: Callable[..., Any] | None = None
        # Frame -> param name -> segment index (latest compile of each frame): alignment.
        # Frames are numbered in the order Dynamo first meets them, i.e. forward order.
        self.param_segments: dict[int, dict[str, int]] = {}
        self._shared: list[Any] = []
        """Blocks compiled for several calls of this backend's graphs (alive as long as it)."""
        if blocks_of is not None and block_calls is not None:
            raise AssertionError("expected the module whose blocks to find or the blocks found, got both")
        found = repeated_blocks(blocks_of) if blocks_of is not None else None
        self.repeated = (found[0], len(found[1])) if found is not None else None
        """The container of the module's repeated blocks and their count (what the report names)."""
        if blocks_of is not None:
            block_calls = find_block_calls(blocks_of) if self._may_share else None
        self.block_calls = block_calls
        """``share_blocks``: the blocks Dynamo meets as one call each (NOTE [Dynamo calls a block]):
        found in ``blocks_of``, or another backend's of the same compiled object (``block_calls``)."""
        self.module = weakref.ref(module) if module is not None else None
        """A plain module compiled without DDP: the parameters its graphs read are counted."""

    def compiled_codes(self) -> list[Any]:
        """The code objects of the frames this backend compiled graphs of."""
        return list(self._codes)

    def alignment(self) -> dict[str, Any]:
        """How the compiled segments coincide with the DDP reducer's buckets (the report's)."""
        ddp = self.ddp
        if ddp is None:
            return {"alignment": None, "status": "no DDP module seen"}
        report = self.report
        eager_code = bool(report.eager_calls) or bool(eager_regions(report.graphs))
        return measure_alignment(ddp, self.param_segments, eager_code=eager_code)

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
        if self._may_share and cfg.capabilities.inductor:
            options = dc.cacheable_calls_options(blocks_cache_targets(), options)
        if self.cudagraphs is None:
            return dc.make_backend(cfg.backend, cfg.mode, options, cfg.dynamic)
        make_inner = inner_compile_factory(self.cudagraphs, auto=cfg.cudagraphs == "auto")
        return dc.compile_with_inner(cfg.mode, options, cfg.dynamic, make_inner)

    @property
    def ddp(self) -> Any | None:
        return self._ddp() if self._ddp is not None else None

    def _decision(self, ddp: Any | None) -> tuple[Decision, FusedState | None]:
        """The decision this graph is compiled under, and under ``fused`` its runtime's state: the
        compiled DDP module's, else one of the backend's own for the DDP module it found (a
        compiled function's)."""
        if self._decisions is not None:
            decision, fused = self._decisions()
            if decision is not None and (ddp is None or decision.ddp_id == id(ddp)):
                return decision, fused
        decision = self._own
        if decision is None or (ddp is not None and decision.ddp_id != id(ddp)):
            decision = decide(
                self.config, ddp, runs_ddp_forward=False, cudagraphs=self.cudagraphs is not None, variant=self.variant
            )
            if ddp is not None and self.variant is Variant.SYNC:
                # A graph of the DDP module's forward: an explicit strategy must apply to it
                # (NOTE [explicit strategies]); graphs of the function outside it have no buckets.
                problem = refusal(self.config, decision, target=f"DDP({type(ddp.module).__name__})")
                if problem is not None:
                    raise ValueError(problem)
            if ddp is not None:
                self._own = decision
        return decision, None

    # torch.compile calls backend(gm, example_inputs)
    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        start, call_us = time.perf_counter(), dc.wall_us()
        # Earlier graphs' records first: later compiles push them out of torch's short list.
        self.report.compile_times.refresh()
        graph_id = len(self.report.graphs)
        cid = dc.current_compile_id()
        code = dc.compiling_code()
        if code is not None:
            self._codes.add(code)
        ddp = self._resolve_ddp()
        decision, fused = self._decision(ddp)
        seen = {
            "op_count": op_count(gm),
            "higher_order_ops": higher_order_ops(gm),
            "break_reason": dc.graph_break_reason(gm),
            "recompile_reason": dc.recompile_reason(),
        }
        # Which inputs are DDP parameters (once), the graph as the strategies see it (identical
        # blocks calling one compile), then where that graph uses each parameter.
        matched = self._param_inputs(gm, example_inputs, ddp)
        frame = _frame_key(cid, graph_id)
        earlier = frozenset(n for key, names in self.param_segments.items() if key < frame for n in names)
        plan = plan_graph(
            self.config, decision, GraphFacts.of(example_inputs, earlier_params=earlier), variant=self.variant
        )
        for text in plan.notes:
            self.report.note(text)
        sharing, unshared = share_in_graph(self, gm, example_inputs, plan, matched)
        params = params_in_graph(gm, matched)
        diagnosed_gm = copy.deepcopy(gm) if doctor.enabled() and plan.strategy is not Strategy.SPLIT else None
        job = GraphJob(gm=gm, example_inputs=example_inputs, params=params, graph_id=graph_id, ddp=ddp)
        if plan.strategy is Strategy.FUSED and fused is None:
            raise AssertionError(f"expected the fused runtime's state with a fused plan, got {plan}")
        result = APPLY[plan.strategy](job, SegmentCompiler(self, Progress(job.label), plan), plan, fused)
        if diagnosed_gm is not None and len(result.segments) == 1:
            # split graphs are diagnosed per segment (the compiler's pieces)
            result.fn = doctor.Diagnosed(result.fn, diagnosed_gm, f"{job.label} segment 0", self.config.backend_name)
        for text in result.notes:
            self.report.note(text)
        extra = sharing.outcomes if sharing is not None else []
        times = backend_call_times(time.perf_counter() - start, [*result.outcomes, *extra], result.rank_check_s)
        self.report.compile_times.track(times, dc.current_compile_id_text(), call_us)
        shared = sharing.to_dict() if sharing is not None else None
        if unshared is not None:
            shared = {"reason": unshared.reason}
            if unshared.blocks is not None:
                self.report.blocks_unshared(*unshared.blocks, reason=unshared.reason, host_time=unshared.host_time)
        self._record(
            graph_id=graph_id, cid=cid, plan=plan, params=params, result=result, times=times, shared=shared, **seen
        )
        if sharing is not None:
            self._shared.extend(sharing.kept)
        return self._wrap(result.fn, gm, example_inputs, ddp, params, plan.strategy)

    def _wrap(
        self,
        fn: Callable[..., Any],
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        ddp: Any | None,
        params: list[GraphParam],
        strategy: Strategy,
    ) -> Callable[..., Any]:
        """What Dynamo calls: the reducer's gradient-ready order (not under ``fused``, whose
        reducer is idle), the delayed allreduce's trigger last, every run counted."""
        if ddp is not None and params and strategy is not Strategy.FUSED:
            fn = FirstIterationOrder(fn, ddp, _forward_positions(gm, params))
        trigger = ddpc.delayed_allreduce_trigger(ddp) if ddp is not None else None
        if trigger is not None:
            positions = [i for i, a in enumerate(example_inputs) if a is trigger]
            fn = ReadyLast(fn, positions) if positions else fn
        return _Counted(fn, self.report)

    def _param_inputs(self, gm: fx.GraphModule, example_inputs: Sequence[Any], ddp: Any | None) -> list[ParamInput]:
        """The graph's inputs that are reducer parameters, but those DDP gives a sparse gradient
        (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``): DDP reduces each of
        those on its own as a sparse tensor, and so do they stay here, outside every bucket
        (DDP's reducer under ``split``/``none``, the fused runtime under ``fused``)."""
        if ddp is None:
            module = self.module() if self.module is not None else None
            if module is None:
                return []
            # No buckets: the parameters the graph reads, counted in the report.
            named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
            return match_params(gm, example_inputs, named)
        named = ddpc.reducer_parameters(ddp)
        found = match_params(gm, example_inputs, named)
        sparse = {id(p) for (_, p), flag in zip(named, ddpc.sparse_gradient_flags(ddp)) if flag}
        for p in found:
            if id(p.tensor) in sparse and p.name not in self._sparse_noted:
                self._sparse_noted.add(p.name)
                self.report.note(
                    f"{p.name}: sparse gradient, reduced on its own as DDP reduces it (outside the buckets)"
                )
        return [p for p in found if id(p.tensor) not in sparse]

    def _resolve_ddp(self) -> Any | None:
        ddp = self.ddp
        if ddp is None and dc.active_ddp_module() is not None:
            # A compiled function calling a DDP module: that module's reducer owns the grads.
            ddp = dc.active_ddp_module()
            self._ddp = weakref.ref(ddp)
        return ddp

    def fused_backend(self, plan: GraphPlan) -> Callable[..., Any]:
        """The backend, with Inductor's comm/compute reordering on (scoped to its compiles)."""
        if self._fused_backend is None:
            cfg = self.config
            if cfg.capabilities.inductor:
                caps = plan.decision.caps
                group = caps is not None and cfg.capabilities.groups_block_reductions
                grouped = grouping_pass(SHARED_BLOCK_BACKWARD.name(), caps.bytes) if group else None
                self._fused_backend = self._make_backend(fused_backend_options(cfg.options, post_grad_pass=grouped))
                if ci.bucket_safe_patches() and torch.cuda.is_available():  # a Triton-only reduction
                    self.report.note(ci.bucket_safe_note())
                if not cfg.capabilities.groups_block_reductions and plan.sharing.enabled:
                    self.report.note(ci.CPP_WRAPPER_UNGROUPED)
            else:
                self._fused_backend = self.segment_backend
        return self._fused_backend

    # -- stats -----------------------------------------------------------------------------

    def _record(
        self,
        *,
        graph_id: int,
        cid: dc.CompileId,
        plan: GraphPlan,
        params: list[GraphParam],
        result: StrategyResult,
        times: CompileTimes,
        op_count: int,
        higher_order_ops: list[str],
        break_reason: str | None,
        recompile_reason: str | None,
        shared: dict[str, Any] | None,
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
                strategy=plan.strategy.value,
                strategy_reason=plan.reason,
                graph_break_reasons=[break_reason] if break_reason else [],
                recompile=recompile,
                recompile_reason=recompile_reason if recompile else None,
                op_count=op_count,
                higher_order_ops=higher_order_ops,
                segments=segments,
                buckets=result.buckets,
                unused_params=sorted(p.name for p in params if p.first_use < 0),
                plan_source=result.plan_source,
                variant=None if self.variant is Variant.SYNC else self.variant.value,
                compile_times=times,
                comm_hook=result.comm_hook,
                variants=result.variants,
                shared_blocks=shared,
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
