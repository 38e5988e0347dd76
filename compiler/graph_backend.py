"""The backend bucketwise hands to ``torch.compile``: one call per Dynamo graph."""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Sequence

import torch.fx as fx

from ..distributed import _ddp_compat
from ..distributed.ddp_optimizer import plan_for_graph, split_and_compile
from ..distributed.plan import BucketCaps
from ..distributed.ready_order import FirstIterationOrder
from ..partitioners.param_usage import GraphParam, find_graph_params, higher_order_ops
from ..partitioners.split import Segment
from . import _dynamo_compat as dc
from .config import CompileConfig
from .progress import Progress
from .report import GraphStats, Report, SegmentStats
from .segments import CompileOutcome, compile_with_fallback

log = logging.getLogger(__name__)


class GraphBackend:
    """Plans, splits and compiles every graph Dynamo captures for one compiled object.

    ``ddp`` is the DDP module whose reducer owns the gradients (``None`` for plain modules and
    functions: graphs are then compiled whole).
    """

    def __init__(self, config: CompileConfig, report: Report, ddp: Any | None) -> None:
        self.config = config
        self.report = report
        self._ddp = weakref.ref(ddp) if ddp is not None else None
        self.segment_backend = dc.make_backend(config.backend, config.mode, config.options, config.dynamic)
        # Graph id -> param name -> segment index, for the alignment figure.
        self.param_segments: dict[int, dict[str, int]] = {}
        self._latest_graph_of_frame: dict[Any, int] = {}

    @property
    def ddp(self) -> Any | None:
        return self._ddp() if self._ddp is not None else None

    # torch.compile calls backend(gm, example_inputs)
    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        graph_id = len(self.report.graphs)
        cid = dc.current_compile_id()
        progress = Progress(f"graph {graph_id}")
        ddp = self.ddp
        if ddp is None and dc.active_ddp_module() is not None:
            # A compiled function calling a DDP module: that module's reducer owns the grads.
            ddp = dc.active_ddp_module()
            self._ddp = weakref.ref(ddp)
        strategy, why = self._strategy_for(ddp)

        if strategy == "split":
            caps = BucketCaps.from_ddp(
                ddp, bucket_cap_mb=self.config.bucket_cap_mb, first_bucket_cap_mb=self.config.first_bucket_cap_mb
            )
            params = find_graph_params(gm, example_inputs, _ddp_compat.reducer_parameters(ddp))
            buckets, plan_source = plan_for_graph(ddp, params, caps)
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
            compiled, segments, outcomes = result.compiled, result.segments, result.outcomes
            unused = sorted(p.name for p in params if p.first_use < 0)
        else:
            plan_source = None
            with progress.step("whole graph", self.config.backend_name):
                compiled, outcome = self._compile_whole(gm, example_inputs)
            params = (
                find_graph_params(gm, example_inputs, _ddp_compat.reducer_parameters(ddp)) if ddp is not None else []
            )
            segments = [Segment(index=0, submodule="", params=[p for p in params if p.first_use >= 0])]
            segments[0].op_count = sum(1 for n in gm.graph.nodes if n.op.startswith("call_"))
            outcomes = [outcome]
            unused = sorted(p.name for p in params if p.first_use < 0)

        self._record(graph_id, cid, gm, strategy, why, segments, outcomes, unused, plan_source)
        if ddp is not None and params:
            compiled = FirstIterationOrder(compiled, ddp, _forward_positions(gm, params))
        return compiled

    def _strategy_for(self, ddp: Any | None) -> tuple[str, str | None]:
        requested = self.config.strategy
        if requested == "none":
            return "none", None
        if ddp is None:
            return "none", "no DDP module: nothing to align with"
        if _ddp_compat.uses_python_reducer(ddp):
            return "none", "DDP's python reducer (compiled autograd) does its own bucketing"
        return "split", None

    def _compile_whole(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[Callable[..., Any], CompileOutcome]:
        return compile_with_fallback(
            gm,
            example_inputs,
            self.segment_backend,
            backend_name=self.config.backend_name,
            fallback=self.config.fallback,
        )

    def _record(
        self,
        graph_id: int,
        cid: dc.CompileId,
        gm: fx.GraphModule,
        strategy: str,
        why: str | None,
        segments: list[Segment],
        outcomes: list[CompileOutcome],
        unused: list[str],
        plan_source: str | None,
    ) -> None:
        reason = dc.graph_break_reason(gm)
        new_breaks = [reason] if reason else []
        recompile = bool(cid.frame_compile_id)
        frame_key = (cid.frame_id,)
        if cid.frame_id is not None:
            previous = self._latest_graph_of_frame.get(frame_key)
            if previous is not None:
                self.param_segments.pop(previous, None)
            self._latest_graph_of_frame[frame_key] = graph_id
        self.param_segments[graph_id] = {p.name: seg.index for seg in segments for p in seg.params}
        stats = [
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
            for seg, out in zip(segments, outcomes)
        ]
        self.report.add_graph(
            GraphStats(
                graph_id=graph_id,
                compile_id=str(cid),
                strategy=strategy,
                strategy_reason=why,
                graph_break_reasons=new_breaks,
                recompile=recompile,
                op_count=sum(1 for n in gm.graph.nodes if n.op.startswith("call_")),
                higher_order_ops=higher_order_ops(gm),
                segments=stats,
                unused_params=unused,
                plan_source=plan_source,
            )
        )


def _forward_positions(gm: fx.GraphModule, params: Sequence[GraphParam]) -> list[int]:
    """Flat argument index of each placeholder parameter, in forward first-use order."""
    index = {node: i for i, node in enumerate(gm.graph.find_nodes(op="placeholder"))}
    used = sorted((p for p in params if p.first_use >= 0 and p.node in index), key=lambda p: (p.first_use, p.arg_position))
    return [index[p.node] for p in used]
