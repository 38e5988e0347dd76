"""Compile one graph or segment with a backend, running it uncompiled where that fails
(``fallback="eager"``), and what the strategies compile a graph's pieces with."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, Sequence

import torch.fx as fx

from .._compat import dynamo as dc
from .._compat import pieces
from ..cudagraphs.runner import runner_label
from ..distributed.result import CompileOutcome, falls_back
from . import doctor
from .blocks.calls import BlockCallRefused, is_block_call
from .decision import Variant
from .progress import Progress

log = logging.getLogger(__name__)


def compile_with_fallback(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    backend_fn: Callable[..., Any],
    *,
    backend_name: str,
    fallback: str,
    tracing: pieces.SegmentTracing | None = None,
) -> tuple[Callable[..., Any], CompileOutcome]:
    """Compile ``gm`` with ``backend_fn``; on failure run it eagerly (``fallback="eager"``,
    reason kept) or re-raise (``fallback="raise"``)."""
    outcome = CompileOutcome(backend=backend_name)
    phases0, counts0 = dc.compile_phase_seconds(), dc.compile_counters()
    depth = dc.functorch_depth()
    start = time.perf_counter()
    try:
        if tracing is not None:
            with tracing.compiling_segment():
                compiled = backend_fn(gm, list(example_inputs))
        else:
            compiled = backend_fn(gm, list(example_inputs))
    except Exception as exc:
        if not falls_back(exc, fallback=fallback, functorch_depth=depth):
            raise
        log.warning("bucketwise: %s compile failed, running eagerly: %s", backend_name, exc)
        compiled = gm
        outcome.fell_back = True
        outcome.reason = f"{type(exc).__name__}: {exc}".strip()[:500]
    outcome.seconds = time.perf_counter() - start
    phases1 = dc.compile_phase_seconds()
    outcome.phases = {k: round(v - phases0.get(k, 0.0), 6) for k, v in phases1.items() if v - phases0.get(k, 0.0) > 0}
    outcome.counts = {k: v - counts0[k] for k, v in dc.compile_counters().items() if v > counts0[k]}
    return compiled, outcome


class SegmentCompiler:
    """What the strategies compile one graph's pieces with (``result.PieceCompiler``): the
    ``GraphBackend``'s backends, the fallback policy, a progress line per piece, the doctor on every segment of a
    split graph, and the name each piece's CUDA-graph runners get."""

    def __init__(self, backend: Any, progress: Progress, plan: Any) -> None:
        self.backend, self.progress, self.plan = backend, progress, plan

    def piece(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], *, label: str, what: str, tracing: Any = None
    ) -> tuple[Callable[..., Any], CompileOutcome]:
        with self.progress.step(what, self.backend.config.backend_name):
            compiled, outcome = self._compile(gm, example_inputs, self.backend.segment_backend, label, tracing)
        if tracing is not None and doctor.enabled():
            compiled = doctor.Diagnosed(compiled, gm, label, self.backend.config.backend_name)
        return compiled, outcome

    def fused(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], *, label: str, what: str
    ) -> tuple[Callable[..., Any], CompileOutcome]:
        with self.progress.step(what, self.backend.config.backend_name):
            return self._compile(gm, example_inputs, self.backend.fused_backend(self.plan), label)

    def variant(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], *, label: str, later: bool
    ) -> tuple[Callable[..., Any], CompileOutcome]:
        out = self._compile(gm, example_inputs, self.backend.fused_backend(self.plan), label)
        if later:
            self.backend.report.write_rank_file()
        return out

    def step(self, what: str) -> contextlib.AbstractContextManager[None]:
        return self.progress.step(what, self.backend.config.backend_name)

    def _compile(
        self,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        backend_fn: Callable[..., Any],
        label: str,
        tracing=None,
    ) -> tuple[Callable[..., Any], CompileOutcome]:
        backend = self.backend
        if backend.variant is not Variant.SYNC:
            label = f"{label} ({backend.variant.value})"
        # A graph that still calls blocks as one op each (NOTE [Dynamo calls a block]) and does not
        # compile is never run eagerly: the frame is traced again with every block inlined, which
        # compiles as it would without shared blocks (HF's reentrant activation checkpointing:
        # AOTAutograd cannot trace its backward around a block call).
        calls = any(is_block_call(node) for node in gm.graph.nodes)
        with runner_label(label):
            try:
                return compile_with_fallback(
                    gm,
                    example_inputs,
                    backend_fn,
                    backend_name=backend.config.backend_name,
                    fallback="raise" if calls else backend.config.fallback,
                    tracing=tracing,
                )
            except Exception as exc:
                if not calls:
                    raise
                raise BlockCallRefused(
                    f"the graph calling each block as one op did not compile: {type(exc).__name__}: {exc}"[:300]
                ) from exc
