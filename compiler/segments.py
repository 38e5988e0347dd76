"""Compile the pieces of a split graph one by one with the user's backend."""

from __future__ import annotations

import dataclasses
import logging
import operator
import time
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from .._compat import dynamo as dc
from . import doctor
from .progress import Progress

log = logging.getLogger(__name__)


@dataclasses.dataclass
class CompileOutcome:
    """What happened when one graph or segment was handed to the backend."""

    backend: str
    seconds: float = 0.0
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    """Compile-cache lookups and AOTAutograd compiles during it (``dc.compile_counters`` difference)."""
    fell_back: bool = False
    reason: str | None = None


class _SegmentCall(torch.nn.Module):
    """Holds a compiled segment in the split GraphModule; unwraps the 1-tuple AOT needs."""

    def __init__(self, fn: Callable[..., Any], unwrap: bool) -> None:
        super().__init__()
        self.fn = fn
        self.unwrap = unwrap

    def forward(self, *args: Any) -> Any:
        out = self.fn(*args)
        if self.unwrap and isinstance(out, (tuple, list)):
            return out[0]
        return out


def _force_tuple_output(gm: fx.GraphModule) -> bool:
    """AOTAutograd-based backends need a tuple output; returns whether one was added."""
    out = next(iter(gm.graph.find_nodes(op="output")))
    if isinstance(out.args[0], (tuple, list)):
        return False
    out.args = ((out.args[0],),)
    gm.recompile()
    return True


def compile_with_fallback(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    backend_fn: Callable[..., Any],
    *,
    backend_name: str,
    fallback: str,
    tracing: dc.SegmentTracing | None = None,
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
        # A compile that failed inside a torch.func transform can leave its functorch level
        # pushed; running on eagerly would then trip Dynamo's guards. Re-raise instead, as
        # plain torch.compile does.
        if fallback == "raise" or dc.functorch_depth() != depth or dc.is_dynamo_control_flow(exc):
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


def compile_segments(
    split_gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    backend_fn: Callable[..., Any],
    *,
    backend_name: str,
    fallback: str,
    progress: Progress,
) -> list[CompileOutcome]:
    """Compile every ``submod_*`` of ``split_gm`` in forward order, replacing it in place.

    Each segment is compiled against fake inputs that carry the strides the previous compiled
    segment really produces (see NOTE [several AOT graphs per Dynamo graph] in _compat/dynamo.py).
    """
    fake_mode = dc.detect_fake_mode(example_inputs)
    tracing = dc.SegmentTracing()
    env: dict[fx.Node, Any] = {}
    placeholders = iter(example_inputs)
    outcomes: list[CompileOutcome] = []
    calls = [n for n in split_gm.graph.nodes if n.op == "call_module"]

    def load(arg: Any) -> Any:
        return fx.node.map_arg(arg, lambda n: env[n])

    with dc.saved_tensor_hooks_disabled():
        for node in split_gm.graph.nodes:
            if node.op == "placeholder":
                env[node] = dc.to_fake(next(placeholders), fake_mode)
            elif node.op == "call_module":
                args = tuple(dc.to_fake(a, fake_mode) for a in load(node.args))
                submod = getattr(split_gm, str(node.target))
                unwrap = _force_tuple_output(submod)
                aot_before = dc.aot_autograd_count()
                with progress.step(f"segment {len(outcomes) + 1}/{len(calls)}", backend_name):
                    compiled, outcome = compile_with_fallback(
                        submod, args, backend_fn, backend_name=backend_name, fallback=fallback, tracing=tracing
                    )
                outcomes.append(outcome)
                if doctor.enabled():
                    where = f"{progress.label} segment {len(outcomes) - 1}"
                    compiled = doctor.Diagnosed(compiled, submod, where, backend_name)
                wrapper = _SegmentCall(compiled, unwrap)
                name = f"compiled_{node.target}"
                split_gm.add_submodule(name, wrapper)
                node.target = name
                with dc.allow_real_inputs(fake_mode):
                    if not outcome.fell_back and dc.aot_autograd_count() != aot_before and tracing.record_segment_metadata():
                        out = wrapper(*args)
                    else:
                        out = submod(*args)
                        if unwrap:
                            out = out[0]
                env[node] = out
            elif node.op == "call_function":
                if node.target is not operator.getitem:
                    raise AssertionError(f"expected only getitem between segments, got {node.format_node()}")
                env[node] = node.target(*load(node.args))
    split_gm.recompile()
    # Drop the uncompiled pieces (still reachable through compiled wrappers if they fell back).
    for node in calls:
        original = str(node.target).removeprefix("compiled_")
        if hasattr(split_gm, original):
            split_gm.delete_submodule(original)
    return outcomes
