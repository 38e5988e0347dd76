"""Compiling a Dynamo graph once per variant its comm hook asks for (NOTE [powersgd in the
graph] in ``fused/powersgd.py``, NOTE [comm hooks in the graph] in ``fused/comm_hooks.py``)."""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch.fx as fx

from ..._compat import dynamo as dc
from ...partitioners.param_usage import GraphParam
from ..result import CompileOutcome, VariantStats
from .comm_hooks import HookProgram
from .sync import fresh_copy

log = logging.getLogger(__name__)


class VariantCompiler:
    """``compile_variant(variant, input_specs)`` for a ``HookedGraph`` (``label``: the graph's,
    ``graph N``): a copy of the Dynamo
    graph with the variant's extra inputs and syncs, compiled against Dynamo's own fake inputs in
    a tracing context of its own (the first variant while Dynamo compiles the frame, later ones
    at the call that first needs them). Every compile is recorded in ``variants``, the list the
    graph's report entry holds; ``on_later_variant`` is called after each compile past the first
    (the report rewrites its rank file)."""

    def __init__(
        self,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        program: HookProgram,
        buckets: Sequence[Sequence[GraphParam]],
        compile_fn: Callable[[fx.GraphModule, list[Any], str], tuple[Callable[..., Any], CompileOutcome]],
        on_later_variant: Callable[[], None],
        label: str,
    ) -> None:
        self.gm = gm  # kept as Dynamo gave it: each variant transforms a copy
        self.inputs = dc.graph_example_inputs(gm, example_inputs)
        self.fake_mode = dc.detect_fake_mode(self.inputs)
        self.program, self.buckets = program, buckets
        self.compile_fn, self.on_later_variant, self.label = compile_fn, on_later_variant, label
        self.variants: list[VariantStats] = []
        self._first: CompileOutcome | None = None

    def __call__(self, variant: Any, input_specs: list[Any]) -> Callable[..., Any]:
        extra = [dc.fake_empty(self.fake_mode, *spec) for spec in input_specs]
        gm, buckets, nodes = fresh_copy(self.gm, self.buckets, extra, "comm_hook_input")
        self.program.insert(gm, buckets, variant, nodes)
        name = self.program.variant_name(variant)
        with dc.fresh_tracing(self.fake_mode):
            compiled, outcome = self.compile_fn(gm, [*self.inputs, *extra], f"{self.label} ({name})")
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
            self.on_later_variant()
        return compiled

    def first_outcome(self) -> CompileOutcome:
        if self._first is None:
            raise AssertionError("expected a variant compiled with the graph, got none")
        return self._first
