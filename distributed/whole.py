"""The ``none`` strategy: each graph compiled whole; DDP's reducer reduces after the backward."""

from __future__ import annotations

from typing import Any, Sequence

import torch.fx as fx

from ..partitioners.param_usage import GraphParam
from ..partitioners.split import Segment
from .result import CompilePiece, StrategyResult, op_count


def apply_whole(
    *, gm: fx.GraphModule, example_inputs: Sequence[Any], params: Sequence[GraphParam], compile_piece: CompilePiece
) -> StrategyResult:
    """``gm`` compiled as one segment holding every parameter it uses; no buckets of its own."""
    compiled, outcome = compile_piece(gm, example_inputs, what="whole graph")
    used = [p for p in params if p.first_use >= 0]
    return StrategyResult(
        fn=compiled,
        segments=[Segment(index=0, submodule="", params=used, op_count=op_count(gm))],
        outcomes=[outcome],
        buckets=[],
    )
