"""What happens to one graph: one frozen plan, built by :func:`plan_graph`.

NOTE [one plan per graph]: a graph's plan is a pure function of frozen inputs: the config (its
backend's ``Capabilities`` included), the DDP module's ``Decision`` (``decision.py``: strategy,
buckets, comm hook and sharing, made once per DDP module), the graph's facts (``GraphFacts``) and
its device's constants (``blocks.find.DeviceCost``). The graph backend builds it for each graph
Dynamo hands over, applies it (``APPLY[plan.strategy]``) and records its reasons in the report;
nothing changes it after. The same model, config and device give the same plan on every rank and
every restart: nothing in it is timed.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch

from .._compat import inductor as ci
from ..distributed.fused import FusedState, apply_fused
from ..distributed.result import GraphJob, StrategyResult
from ..distributed.split import apply_split
from ..distributed.whole import apply_whole
from .blocks.find import DeviceCost, device_cost
from .config import CompileConfig
from .decision import BlockSharing, Decision, Strategy, Variant
from .segments import SegmentCompiler


@dataclasses.dataclass(frozen=True, kw_only=True)
class GraphFacts:
    """What a plan needs to know of one graph."""

    devices: frozenset[torch.device]
    """The devices of its tensor inputs."""
    earlier_params: frozenset[str] = frozenset()
    """``split``: the parameters frames compiled before this one take (their buckets' cuts)."""

    @classmethod
    def of(cls, example_inputs: Sequence[Any], *, earlier_params: frozenset[str] = frozenset()) -> GraphFacts:
        devices = frozenset(a.device for a in example_inputs if isinstance(a, torch.Tensor))
        return cls(devices=devices, earlier_params=earlier_params)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GraphPlan:
    """What one graph gets (NOTE [one plan per graph])."""

    decision: Decision
    """The DDP module's (strategy and its reason, buckets, comm hook)."""
    variant: Variant
    sharing: BlockSharing
    """Whether this graph's identical blocks share one compile, and why not."""
    cost: DeviceCost | None = None
    """Shared only where a block's call hides behind its kernels on this device (NOTE [sharing by
    cost]); ``None``: shared without that check."""
    gather_rows: bool = False
    """``fused``: embedding tables' gradients reduced as the rows looked up (NOTE [embedding rows])."""
    rows_off: str | None = None
    """Why they are not though the config asks (NOTE [collectives the C++ wrapper cannot call])."""
    earlier_params: frozenset[str] = frozenset()
    fallback: str = "eager"
    notes: tuple[str, ...] = ()
    """What the report notes about this plan (the reasons of its choices)."""

    @property
    def strategy(self) -> Strategy:
        return self.decision.strategy

    @property
    def reason(self) -> str | None:
        return self.decision.reason


def plan_graph(config: CompileConfig, decision: Decision, facts: GraphFacts, *, variant: Variant) -> GraphPlan:
    """The plan of one graph (NOTE [one plan per graph])."""
    sharing, cost, notes = decision.sharing, None, []
    if sharing.enabled and sharing.by_cost:
        # The estimate is of Inductor's kernels on one GPU (NOTE [sharing by cost]).
        inductor, devices = config.capabilities.inductor, facts.devices
        if inductor and len(devices) == 1 and next(iter(devices)).type == "cuda":
            cost, note = device_cost(next(iter(devices)))
            if note is not None:
                notes.append(f"share_blocks='auto': {note}")
        else:
            where = "compiles with another backend" if not inductor else "does not run on one GPU"
            sharing = BlockSharing(
                enabled=False,
                reason="share_blocks='auto' shares blocks without CUDA graphs where a block's call, estimated for "
                f"Inductor's kernels on one GPU, hides behind them; this graph {where}. Pass share_blocks=True for "
                "a shorter first step all the same",
            )
    asked = config.gather_embedding_rows and decision.fused
    rows_off = ci.CPP_WRAPPER_NO_ROWS if asked and not config.capabilities.gathers_rows else None
    return GraphPlan(
        decision=decision,
        variant=variant,
        sharing=sharing,
        cost=cost,
        gather_rows=asked and rows_off is None,
        rows_off=rows_off,
        earlier_params=facts.earlier_params,
        fallback=config.fallback,
        notes=tuple(notes),
    )


# What each strategy does to a graph under its plan (NOTE [one plan per graph]).
def _apply_split(job: GraphJob, compiler: SegmentCompiler, plan: GraphPlan, fused: FusedState | None) -> StrategyResult:
    caps = plan.decision.caps
    return apply_split(job, compiler, earlier_names=plan.earlier_params, caps=caps, fallback=plan.fallback)


def _apply_fused(job: GraphJob, compiler: SegmentCompiler, plan: GraphPlan, fused: FusedState | None) -> StrategyResult:
    decision = plan.decision
    return apply_fused(
        job,
        compiler,
        caps=decision.caps,
        spec=decision.spec,
        comm_hook=decision.comm_hook,
        gather_rows=plan.gather_rows,
        rows_off=plan.rows_off,
        state=fused,
    )


def _apply_whole(job: GraphJob, compiler: SegmentCompiler, plan: GraphPlan, fused: FusedState | None) -> StrategyResult:
    return apply_whole(job, compiler)


APPLY: dict[Strategy, Callable[[GraphJob, SegmentCompiler, GraphPlan, FusedState | None], StrategyResult]] = {
    Strategy.SPLIT: _apply_split,
    Strategy.FUSED: _apply_fused,
    Strategy.NONE: _apply_whole,
}
