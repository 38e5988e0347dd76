"""Per gradient bucket, from a profiler trace: communication time, overlapped, exposed, wire bytes."""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Sequence

from . import trace_analysis as ta
from .table import align

STEP_MARK = "bucketwise.step"
"""A ``record_function`` range opened and closed at the start of every profiled step."""

HOST_BOUND_BUSY = 0.8
"""A step whose GPU is busy less than this fraction of it is host-bound (NOTE [saying when the host is the step])."""

_SOURCES = {
    "cuda": "NCCL kernels against the other kernels on the GPU",
    "cpu": "gloo's ranges on its threads against the training thread outside c10d calls and waits "
    "(CPU: no NCCL kernels; per-bucket NCCL kernel timing needs CUDA)",
    "none": "no collective in the trace",
}


@dataclasses.dataclass(frozen=True)
class BucketTime:
    """One bucket's communication per step (``graph_id`` ``None``: collectives of no bucket)."""

    graph_id: int | None
    index: int | None
    collective: str
    params: int | None
    grad_bytes: int | None
    wire_bytes: int | None
    """What the report plans each rank to send (after compression; a gathered table's rows and ids)."""
    measured_bytes: int | None
    """What the trace shows this rank sending per step, where it says."""
    calls: float
    """Collectives per step (a table looked up twice is gathered twice)."""
    comm_ms: float
    overlapped_ms: float
    exposed_ms: float

    @property
    def label(self) -> str:
        return "other" if self.graph_id is None else f"g{self.graph_id}b{self.index}"

    def cells(self) -> tuple[str, ...]:
        """Graph, bucket, collective, grad MiB and wire MiB (measured where the trace says)."""
        wire = self.measured_bytes if self.measured_bytes is not None else self.wire_bytes
        graph = "other" if self.graph_id is None else str(self.graph_id)
        index = "" if self.index is None else str(self.index)
        return (graph, index, self.collective, _mib(self.grad_bytes), _mib(wire))


@dataclasses.dataclass
class RuntimeView:
    """Per-bucket communication of some profiled training steps of one rank."""

    target: str
    rank: int
    world_size: int
    host: str
    steps: int
    source: str
    """``"cuda"``, ``"cpu"`` (gloo on host threads) or ``"none"`` (no collective found)."""
    step_ms: float
    comm_ms: float
    overlapped_ms: float
    exposed_ms: float
    wire_bytes: int
    """Bytes this rank sent per step, from the trace."""
    buckets: list[BucketTime]
    other: BucketTime | None
    timeline: dict[str, Any]
    """The last profiled step, as :func:`plot_timeline` draws it."""
    trace_path: str | None = None
    plot_path: str | None = None
    notes: list[str] = dataclasses.field(default_factory=list)
    gpu_busy_ms: float | None = None
    """Per step, the time in which any GPU kernel ran (``None`` without GPU kernels in the trace)."""
    cpu_ms: float | None = None
    """Per step, the process's CPU time, every thread (NOTE [a step's CPU time]), profiler included."""
    peak_allocated_mib: float | None = None
    """The caching allocator's peak so far: not reset by the profile, so compiling and earlier steps count."""
    reserved_mib: float | None = None
    """CUDA memory the caching allocator held when the profile ended (what the device lends it)."""

    @property
    def host_bound(self) -> bool:
        """The GPU sat idle for more than a fifth of the step: the host issuing it is the step."""
        return self.gpu_busy_ms is not None and self.gpu_busy_ms < HOST_BOUND_BUSY * self.step_ms

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "host_bound": self.host_bound}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RuntimeView:
        d = {k: v for k, v in data.items() if k != "host_bound"}
        d["buckets"] = [BucketTime(**b) for b in d["buckets"]]
        d["other"] = BucketTime(**d["other"]) if d.get("other") else None
        return cls(**d)

    def table(self) -> str:
        """Aligned text: one row per bucket, then the step's totals and where the figures come from."""
        rows = [(*_HEAD[:3], "params", *_HEAD[3:], "calls/step", "comm ms", "overlapped", "exposed")]
        for b in [*self.buckets, *([self.other] if self.other else [])]:
            graph, index, collective, grad, wire = b.cells()
            params = "-" if b.params is None else str(b.params)
            times = (f"{getattr(b, f):.3f}" for f in _TIMES)
            rows.append((graph, index, collective, params, grad, wire, f"{b.calls:g}", *times))
        lines = [_align(rows)] if len(rows) > 1 else []
        lines.append(totals_line(self))
        lines.append(f"source: {_SOURCES.get(self.source, self.source)}")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


def totals_line(view: RuntimeView) -> str:
    cpu = "" if view.cpu_ms is None else f" (CPU time {view.cpu_ms:.2f} ms)"
    busy = "" if view.gpu_busy_ms is None else f", GPU busy {view.gpu_busy_ms:.2f} ms"
    memory = (
        ""
        if view.peak_allocated_mib is None
        else f"; CUDA memory: peak allocated {view.peak_allocated_mib:,.0f} MiB so far, "
        f"{view.reserved_mib or 0:,.0f} MiB reserved"
    )
    return (
        f"rank {view.rank}: {view.steps} profiled step(s), {view.step_ms:.2f} ms per step{cpu}{busy}; communication "
        f"{view.comm_ms:.3f} ms per step, {view.overlapped_ms:.3f} overlapped with compute, "
        f"{view.exposed_ms:.3f} exposed; {view.wire_bytes / 2**20:.2f} MiB sent per step{memory}"
    )


# NOTE [saying when the host is the step]: the host can issue a step of small kernels slower than
# the GPU runs them (a launch costs tens of microseconds on a virtual machine); then bucket sizes
# and overlap change nothing. The trace shows it without a guess: the union of the GPU's kernels
# against the step's wall time. The note says what to try: CUDA graphs (one launch per graph), or,
# where they already replay, that the host time is outside them; shared blocks called without CUDA
# graphs are named, as each call costs its own launches and checks (share_blocks=False avoids them).


HOST_BOUND_PREFIX = "host-bound: "


# NOTE [saying when sharing blocks is free]: without CUDA graphs share_blocks="auto" compiles
# repeated blocks with the whole graph where a shared block's call would cost host time its
# kernels do not hide (NOTE [sharing by cost]), estimated from one block's graphs, not the whole
# step. A step bound by its GPU does not pay that time, and sharing compiles one block, not all:
# there the view advises share_blocks=True for the user to compare, not a change. The profiler
# slows the host, so GPU_BOUND_BUSY lies between what GPU-bound and host-bound steps show.

GPU_BOUND_BUSY = 0.9
"""A step whose GPU is busy at least this fraction of it has host time to spare."""

GPU_BOUND_PREFIX = "GPU-bound: "


def shared_blocks_note(view: RuntimeView, report: dict[str, Any]) -> str | None:
    """The advice when the GPU is the step and blocks stayed unshared for host time only."""
    if view.gpu_busy_ms is None or view.gpu_busy_ms < GPU_BOUND_BUSY * view.step_ms:
        return None
    if any(g.get("strategy") == "split" for g in report.get("graphs", [])):
        return None  # under split a shared block is never cut: its segments would merge
    left = [u for u in report.get("unshared_blocks", []) if u.get("host_time")]
    if not left:
        return None
    blocks = " and ".join(f"the {u['blocks']} blocks of `{u['container']}`" for u in left)
    return (
        f"{GPU_BOUND_PREFIX}the GPU was busy {view.gpu_busy_ms:.2f} of {view.step_ms:.2f} ms per step "
        f"({min(1.0, view.gpu_busy_ms / view.step_ms):.0%}); {blocks} compiled with the whole graph, which "
        "share_blocks='auto' does without CUDA graphs for the host time a shared block's call costs. With the "
        "GPU the step, share_blocks=True compiles identical blocks once (a shorter first step) and can step as "
        "fast: compare its step time with this one (docs/limitations.md, 'Sharing one compile')"
    )


def host_bound_note(view: RuntimeView, report: dict[str, Any]) -> str | None:
    """The advice when the steps are host-bound: it depends on CUDA graphs and shared blocks."""
    if not view.host_bound or view.gpu_busy_ms is None:
        return None
    head = (
        f"{HOST_BOUND_PREFIX}the GPU was busy {view.gpu_busy_ms:.2f} of {view.step_ms:.2f} ms per step "
        f"({view.gpu_busy_ms / view.step_ms:.0%}); the host issuing kernels is the step"
    )
    if any(c.get("captured") for c in report.get("cudagraphs", [])):
        return (
            head + "; the compiled graphs already replay as CUDA graphs, so the host time is outside them "
            "(optimizer step, data loading, Python)"
        )
    # A graph's ``shared_blocks`` is what was shared, or only why nothing was (``reason``).
    shared = [s for g in report.get("graphs", []) if "count" in (s := g.get("shared_blocks") or {})]
    blocks = " and ".join(f"the {s['count']} blocks of `{s['blocks']}`" for s in shared)
    return (
        head + "; bucketwise.compile(..., cudagraphs=True) replays each compiled graph with one launch "
        "(its memory cost: docs/performance.md)"
        + (
            f". {blocks} share one compile, and each shared call costs the host time every step: with CUDA "
            "graphs that cost goes, or share_blocks=False compiles them with the whole graph (a longer first step; "
            "docs/limitations.md, 'Sharing one compile')"
            if shared
            else ""
        )
    )


_HEAD = ("graph", "bucket", "collective", "grad MiB", "wire MiB")
_TIMES = ("comm_ms", "overlapped_ms", "exposed_ms")


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def _align(rows: list[tuple[str, ...]]) -> str:
    return align(rows, right=lambda i: i != 2)  # all but the collective's name


# -- analysis -------------------------------------------------------------------------------


def analyze(
    events: Sequence[dict[str, Any]],
    report: dict[str, Any],
    *,
    steps: int,
    step_ms: float,
    host: str = "",
    cpu_ms: float | None = None,
    memory_mib: tuple[float, float] | None = None,
) -> RuntimeView:
    """``memory_mib``: CUDA memory (peak allocated so far, reserved)."""
    if steps < 1:
        raise ValueError(f"steps: expected at least 1 profiled step, got {steps}")
    comm, compute, source = ta.collectives(events)
    planned = ta.planned_buckets(report)
    matched, other = ta.attribute(comm, planned)
    buckets = sorted(
        (_row(b, matched[i], compute, steps) for i, b in enumerate(planned)), key=lambda r: (r.graph_id, r.index)
    )
    total_us, over_us = ta.comm_figures(comm, compute)
    notes = []
    idle = [b.label for b in buckets if b.calls == 0]
    if idle and comm:
        notes.append(
            f"no collective matched bucket(s) {', '.join(idle)} in the profiled steps (no_sync() steps, a "
            "graph that did not run, or buckets DDP's reducer does not have: see alignment)"
        )
    unsized = sum(1 for c in comm if c.nbytes is None)
    if unsized:
        notes.append(f"{unsized} collective(s) without a size in the trace are counted as other")
    busy_us = ta.gpu_busy_us(events)
    one_graph = len({b.graph_id for b in planned}) == 1
    labels = {
        id(c): f"b{b.index}" if one_graph else f"g{b.graph_id}b{b.index}"
        for i, b in enumerate(planned)
        for c in matched[i]
    }
    view = RuntimeView(
        target=str(report.get("target")),
        rank=int(report.get("rank", 0)),
        world_size=int(report.get("world_size", 1)),
        host=host,
        steps=steps,
        source=source,
        step_ms=step_ms,
        comm_ms=total_us / 1e3 / steps,
        overlapped_ms=over_us / 1e3 / steps,
        exposed_ms=(total_us - over_us) / 1e3 / steps,
        wire_bytes=sum(c.nbytes or 0 for c in comm) // steps,
        buckets=buckets,
        other=_row(None, other, compute, steps) if other else None,
        timeline=_last_step(events, comm, compute, source, labels),
        notes=notes,
        gpu_busy_ms=None if busy_us is None else busy_us / 1e3 / steps,
        cpu_ms=cpu_ms,
        peak_allocated_mib=None if memory_mib is None else memory_mib[0],
        reserved_mib=None if memory_mib is None else memory_mib[1],
    )
    for note in (host_bound_note(view, report), shared_blocks_note(view, report)):
        if note:
            view.notes.append(note)
    return view


def _row(b: ta.PlannedBucket | None, comm: list[ta.Collective], compute: list[ta.Interval], steps: int) -> BucketTime:
    total, over = ta.comm_figures(comm, compute)
    sizes = [c.nbytes for c in comm if c.nbytes is not None]
    kinds = sorted({c.kind for c in comm})
    return BucketTime(
        graph_id=None if b is None else b.graph_id,
        index=None if b is None else b.index,
        collective=b.kind if b is not None else ("/".join(kinds) or "-"),
        params=None if b is None else b.params,
        grad_bytes=None if b is None else b.grad_bytes,
        wire_bytes=None if b is None else b.wire_bytes,
        measured_bytes=sum(sizes) // steps if sizes else None,
        calls=round(len(comm) / steps, 3),
        comm_ms=total / 1e3 / steps,
        overlapped_ms=over / 1e3 / steps,
        exposed_ms=(total - over) / 1e3 / steps,
    )


def _last_step(
    events: Sequence[dict[str, Any]],
    comm: list[ta.Collective],
    compute: list[ta.Interval],
    source: str,
    labels: dict[int, str],
) -> dict[str, Any]:
    lo = ta.last_step_start(events, STEP_MARK, source)
    window = "the last profiled step"
    if lo is None:
        lo, window = float("-inf"), "all profiled steps (no step mark in the trace)"
    clipped = [(max(s, lo), e) for s, e in compute if e > lo]
    spans = [(c.start, c.end, labels.get(id(c), "other")) for c in comm if c.start >= lo]
    return {"window": window, "comm_label": "NCCL" if source == "cuda" else "collective", **ta.timeline(clipped, spans)}


# -- across ranks -----------------------------------------------------------------------------


def merged_table(views: Sequence[RuntimeView]) -> str:
    """Per bucket the median over ranks and the largest exposed time with its rank; a line per rank."""
    by_key: dict[tuple[Any, Any], list[tuple[int, BucketTime]]] = {}
    for v in views:
        for b in [*v.buckets, *([v.other] if v.other else [])]:
            by_key.setdefault((b.graph_id, b.index), []).append((v.rank, b))
    rows = [(*_HEAD, "comm ms", "overlapped", "exposed", "exposed max")]
    for key in sorted(by_key, key=lambda k: (k[0] is None, k[0] or 0, k[1] or 0)):
        seen = by_key[key]
        worst_rank, worst = max(seen, key=lambda rb: rb[1].exposed_ms)
        medians = [f"{statistics.median(getattr(b, f) for _, b in seen):.3f}" for f in _TIMES]
        rows.append((*seen[0][1].cells(), *medians, f"{worst.exposed_ms:.3f} (rank {worst_rank})"))
    ranks = sorted(views, key=lambda v: v.rank)
    head = (
        f"bucketwise: runtime per bucket, ms per step, median over {len(ranks)} rank(s); "
        f"source: {_SOURCES.get(ranks[0].source, ranks[0].source)}"
    )
    lines = [head, _align(rows)]
    lines += [totals_line(v) for v in ranks]
    for v in ranks:
        files = ", ".join(p for p in (v.trace_path, v.plot_path) if p)
        if files:
            lines.append(f"rank {v.rank} trace{' and timeline' if v.plot_path else ''} ({v.host}): {files}")
    notes: list[str] = []
    for v in ranks:
        notes += [n for n in v.notes if n not in notes]
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)


# -- plot -----------------------------------------------------------------------------------


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, or ``None`` when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_timeline(data: dict[str, Any], path: str, title: str) -> bool:
    """One step's compute and collectives as a PNG; False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(12, 2.8))
    compute = [(s, e - s) for s, e in data["compute"]]
    ax.broken_barh(compute, (10, 8), facecolors="tab:gray")
    palette = ("tab:red", "tab:purple")
    for i, (s, e, label) in enumerate(data["nccl"]):
        ax.broken_barh([(s, e - s)], (0, 8), facecolors=palette[i % 2])
        if len(data["nccl"]) <= 40:
            text = label if data.get("comm_label") and len(label) <= 8 else str(i)
            ax.annotate(text, (s + (e - s) / 2, 4), ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks([4, 14], [data.get("comm_label", "NCCL"), "compute"])
    ax.set_xlabel(f"ms ({data['window']})")
    ax.set_title(title, fontsize=10)
    ax.set_ylim(-2, 20)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
