"""The ``none`` strategy: each graph compiled whole; DDP's reducer reduces after the backward."""

from __future__ import annotations

from ..partitioners.split import Segment
from .result import GraphJob, PieceCompiler, StrategyResult, op_count


def apply_whole(job: GraphJob, compiler: PieceCompiler) -> StrategyResult:
    """The graph compiled as one segment holding every parameter it uses; no buckets of its own."""
    compiled, outcome = compiler.piece(job.gm, job.example_inputs, label=f"{job.label} segment 0", what="whole graph")
    used = [p for p in job.params if p.first_use >= 0]
    return StrategyResult(
        fn=compiled,
        segments=[Segment(index=0, submodule="", params=used, op_count=op_count(job.gm))],
        outcomes=[outcome],
        buckets=[],
    )
