"""Compile one graph or segment with a backend, running it uncompiled where that fails
(``fallback="eager"``)."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import torch.fx as fx

from .._compat import dynamo as dc
from .._compat import pieces
from ..distributed.result import CompileOutcome, falls_back

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
