"""Where each graph's compile seconds go, and what the compile caches did.

NOTE [compile-time breakdown]: a Dynamo graph compiles in three steps: (1) Dynamo traces and
builds guards; (2) the backend call: bucketwise's work (``bucketwise_s``, of which
``rank_check_s``), AOTAutograd, and Inductor's ``compile_fx_inner`` on the forward; (3) the lazy
backward compile. Step 2 is timed around the call: ``backend_s`` from torch's timer of
``compile_fx_inner`` (the whole call for a non-AOTAutograd backend), the rest
``aot_autograd_s``, cache outcomes from torch's counters. Steps 1 and 3 come from torch's
``CompilationMetrics`` (only the latest 64 kept), added when the report is read, at the next
compile and on the first calls after one. A backward cache lookup that neither hit nor missed
was bypassed (torch counts no bypass).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from .._compat import compile_records as cr
from .._compat import dynamo as dc

POLLS_AFTER_COMPILE = 3
"""Calls after a compile that look for torch's records of it (frame, then the lazy backward)."""


@dataclasses.dataclass
class CacheCounts:
    """Lookups of one compile cache: served from the cache, compiled and stored, or not cacheable."""

    hit: int = 0
    miss: int = 0
    bypass: int = 0


@dataclasses.dataclass
class CompileTimes:
    """One graph's compile seconds by phase, and its compile-cache lookups."""

    dynamo_s: float | None = None
    """Dynamo's own time on the frame (tracing, guards, bytecode); ``None`` until torch's record
    of the frame is read."""
    bucketwise_s: float = 0.0
    """bucketwise's planning, graph passes and rank checks."""
    rank_check_s: float = 0.0
    """Part of ``bucketwise_s``: the cross-rank layout check (``fused``), waiting included."""
    aot_autograd_s: float | None = None
    """AOTAutograd: tracing, partitioning, cache lookups and loads (forward and backward);
    ``None`` for a backend that is not AOTAutograd-based."""
    backend_s: float = 0.0
    """The backend proper: Inductor's ``compile_fx_inner`` (forward and backward)."""
    backward_compiles: int = 0
    """Backward graphs compiled lazily so far (at the first backward; none after an
    AOTAutograd cache hit, which loads the backward with the forward)."""
    fx_graph_cache: CacheCounts = dataclasses.field(default_factory=CacheCounts)
    aot_autograd_cache: CacheCounts = dataclasses.field(default_factory=CacheCounts)

    @property
    def total_s(self) -> float:
        return (self.dynamo_s or 0.0) + self.bucketwise_s + (self.aot_autograd_s or 0.0) + self.backend_s

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for key in ("dynamo_s", "bucketwise_s", "rank_check_s", "aot_autograd_s", "backend_s"):
            if d[key] is not None:
                d[key] = round(d[key], 6)
        d["total_s"] = round(self.total_s, 6)
        return d


def backend_call_times(call_s: float, outcomes: Iterable[Any], rank_check_s: float) -> CompileTimes:
    """Step 2 of NOTE [compile-time breakdown]; ``outcomes``: the compiles the backend handed on."""
    outcomes = list(outcomes)
    compiled = sum(o.seconds for o in outcomes)
    inductor = sum(dc.inductor_seconds(o.phases) for o in outcomes)
    counts = {k: sum(o.counts.get(k, 0) for o in outcomes) for k in dc.COMPILE_COUNTERS}
    times = CompileTimes(bucketwise_s=max(0.0, call_s - compiled), rank_check_s=rank_check_s)
    if counts["aot_graphs"]:
        times.aot_autograd_s = max(0.0, compiled - inductor)
        times.backend_s = inductor
    else:
        times.backend_s = compiled
    times.fx_graph_cache = CacheCounts(counts["fx_hit"], counts["fx_miss"], counts["fx_bypass"])
    times.aot_autograd_cache = CacheCounts(counts["aot_hit"], counts["aot_miss"], counts["aot_bypass"])
    return times


@dataclasses.dataclass
class _Tracked:
    times: CompileTimes
    compile_id: str
    call_us: int
    """Wall-clock microseconds when the backend was called (inside the frame's compile)."""
    claimed: set[tuple[int, bool]] = dataclasses.field(default_factory=set)


class CompileTimesTracker:
    """Adds torch's records of each graph's frame and lazy backward compiles to its
    :class:`CompileTimes` (steps 1 and 3 of NOTE [compile-time breakdown])."""

    def __init__(self) -> None:
        self._tracked: list[_Tracked] = []

    def track(self, times: CompileTimes, compile_id: str | None, call_us: int) -> None:
        if compile_id is not None:
            self._tracked.append(_Tracked(times, compile_id, call_us))

    def compiled_within(self, start_us: int, end_us: int) -> float:
        """Of the graphs whose backend was called between the two times, lazy backwards included."""
        self.refresh()
        return sum(t.times.total_s for t in self._tracked if start_us <= t.call_us <= end_us)

    def refresh(self) -> bool:
        """Read torch's records; whether any graph gained figures."""
        if not self._tracked:
            return False
        records = cr.compile_records()
        return any([self._claim(t, records) for t in self._tracked])

    @staticmethod
    def _claim(t: _Tracked, records: list[cr.CompileRecord]) -> bool:
        """The frame record holds the backend call; backward records of the same compile id
        follow it, up to the next frame compiled under that id (ids restart after a reset)."""
        changed = False
        # torch 2.11 also files runtime records under the compile id (Triton autotuning at the
        # first calls of the forward and of the backward): no compile seconds, not a frame.
        mine = [
            r for r in records if r.compile_id == t.compile_id and (r.frame_s is not None or r.backward_s is not None)
        ]
        for r in mine:
            key = (r.start_us, r.forward)
            if r.forward and r.start_us > t.call_us:
                break  # another frame under the same id: what follows is its
            if key in t.claimed:
                continue
            if r.forward and (r.end_us is None or r.end_us >= t.call_us):
                t.claimed.add(key)
                t.times.dynamo_s = (
                    max(0.0, r.frame_s - r.backend_s) if r.frame_s is not None and r.backend_s is not None else None
                )
                changed = True
            elif not r.forward and r.start_us > t.call_us:
                t.claimed.add(key)
                _add_backward(t.times, r)
                changed = True
        return changed


def _add_backward(times: CompileTimes, r: cr.CompileRecord) -> None:
    total, inductor = r.backward_s or 0.0, r.inductor_s or 0.0
    times.backward_compiles += 1
    times.backend_s += inductor
    if times.aot_autograd_s is not None:
        times.aot_autograd_s += max(0.0, total - inductor)
    else:
        times.backend_s += max(0.0, total - inductor)
    times.fx_graph_cache.hit += r.fx_hit
    times.fx_graph_cache.miss += r.fx_miss
    if inductor > 0 and r.fx_hit + r.fx_miss == 0:
        times.fx_graph_cache.bypass += 1


def sum_compile_times(items: Iterable[CompileTimes | None]) -> dict[str, Any]:
    """The breakdown of several graphs added up (a phase no graph has a figure for stays ``None``)."""
    known = [t for t in items if t is not None]
    total = CompileTimes(
        dynamo_s=_sum_known(t.dynamo_s for t in known),
        bucketwise_s=sum(t.bucketwise_s for t in known),
        rank_check_s=sum(t.rank_check_s for t in known),
        aot_autograd_s=_sum_known(t.aot_autograd_s for t in known),
        backend_s=sum(t.backend_s for t in known),
        backward_compiles=sum(t.backward_compiles for t in known),
    )
    for t in known:
        for mine, theirs in (
            (total.fx_graph_cache, t.fx_graph_cache),
            (total.aot_autograd_cache, t.aot_autograd_cache),
        ):
            mine.hit, mine.miss, mine.bypass = (
                mine.hit + theirs.hit,
                mine.miss + theirs.miss,
                mine.bypass + theirs.bypass,
            )
    return total.to_dict()


def _sum_known(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


BREAKDOWN_HEADER = (
    "graph",
    "dynamo s",
    "bucketwise s",
    "rank check s",
    "AOTAutograd s",
    "backend s",
    "total s",
    "bw compiles",
    "FX cache h/m/b",
    "AOT cache h/m/b",
)


def breakdown_row(label: str, d: dict[str, Any]) -> tuple[str, ...]:
    """A row of the compile-time table from a :meth:`CompileTimes.to_dict`."""

    def s(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    def c(v: dict[str, int]) -> str:
        return f"{v['hit']}/{v['miss']}/{v['bypass']}"

    return (
        label,
        s(d["dynamo_s"]),
        s(d["bucketwise_s"]),
        s(d["rank_check_s"]),
        s(d["aot_autograd_s"]),
        s(d["backend_s"]),
        s(d["total_s"]),
        str(d["backward_compiles"]),
        c(d["fx_graph_cache"]),
        c(d["aot_autograd_cache"]),
    )


BREAKDOWN_FOOTER = (
    "compile s by phase: dynamo: tracing the frame, guards; bucketwise: planning, graph passes, rank "
    "checks (waiting for other ranks included); AOTAutograd: tracing, partitioning, cache lookups "
    "and loads; backend: Inductor's compiles (forward, and the backward at the first backward); "
    "h/m/b: cache hits/misses/bypasses"
)
