"""Compiling a Dynamo graph once per variant its comm hook asks for (NOTE [comm hooks in the graph])."""

from __future__ import annotations

import logging
from typing import Any, Sequence

from ..._compat import pieces
from ...partitioners.param_usage import GraphParam
from ..result import CompileOutcome, GraphJob, PieceCompiler, VariantStats
from .comm_hooks import HookProgram
from .sync import fresh_copy

log = logging.getLogger(__name__)


class VariantCompiler:
    """``compile_variant`` for a ``HookedGraph``: a copy of Dynamo's graph with the variant's inputs
    and syncs, compiled in a tracing context of its own (later variants at their first call), each
    recorded in ``variants`` (the graph's report entry)."""

    def __init__(
        self, job: GraphJob, program: HookProgram, buckets: Sequence[Sequence[GraphParam]], compiler: PieceCompiler
    ) -> None:
        self.gm = job.gm  # kept as Dynamo gave it: each variant transforms a copy
        self.inputs = pieces.graph_example_inputs(job.gm, job.example_inputs)
        self.fake_mode = pieces.detect_fake_mode(self.inputs)
        self.program, self.buckets = program, buckets
        self.compiler, self.label = compiler, job.label
        self.variants: list[VariantStats] = []
        self._first: CompileOutcome | None = None

    def __call__(self, variant: Any, input_specs: list[Any]) -> Any:
        extra = [pieces.fake_empty(self.fake_mode, *spec) for spec in input_specs]
        gm, buckets, nodes = fresh_copy(self.gm, self.buckets, extra, "comm_hook_input")
        self.program.insert(gm, buckets, variant, nodes)
        name = self.program.variant_name(variant)
        later = self._first is not None
        with pieces.fresh_tracing(self.fake_mode):
            compiled, outcome = self.compiler.variant(
                gm, [*self.inputs, *extra], label=f"{self.label} ({name}) segment 0", later=later
            )
        self.variants.append(
            VariantStats(
                name=name,
                compile_seconds=round(outcome.seconds, 6),
                phases=outcome.phases,
                backend=outcome.backend if not outcome.fell_back else "eager",
                fell_back=outcome.fell_back,
                reason=outcome.reason,
            )
        )
        if self._first is None:
            self._first = outcome
        else:
            log.info("bucketwise: %s: compiled the %s variant (%.2f s)", self.label, name, outcome.seconds)
        return compiled

    def first_outcome(self) -> CompileOutcome:
        if self._first is None:
            raise AssertionError("expected a variant compiled with the graph, got none")
        return self._first
