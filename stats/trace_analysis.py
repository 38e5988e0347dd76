"""Communication and compute per gradient bucket, read from a ``torch.profiler`` Chrome trace (the
exported JSON, stable across torch versions; times in microseconds).

- CUDA: NCCL kernels are the collectives, sized in ``args``; other kernels are compute.
  ``args.correlation`` ties a kernel to the CPU range that launched it.
- CPU (gloo): each collective is a ``gloo:<op>`` range on a gloo thread. Compute is what the
  training threads do outside c10d's ops and waits: "exposed" means the host waited on gloo.

NOTE [collectives to buckets]: a trace does not say which bucket a collective reduces, so a
collective is matched by kind and bytes to the buckets putting that on the wire (``wire_bytes``
under ``fused``, gradient bytes under ``split``); equal ones take collectives in turn, in backward
issue order (exact while every step runs each once). All-gathers of no bucket's size go to the one
gathered table that matched nothing else. What matches no bucket is "other".
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any, Iterable, Sequence

Interval = tuple[float, float]
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")

_DTYPE_BYTES = {
    name: size
    for size, names in (
        (1, "char int8 signedchar byte uint8 unsignedchar bool"),
        (2, "bfloat16 half float16 short int16"),
        (4, "float float32 int int32"),
        (8, "double float64 long longint int64"),
    )
    for name in names.split()
}


# -- intervals ----------------------------------------------------------------------------


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """Union of intervals as a sorted list of disjoint intervals."""
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def length(intervals: Sequence[Interval]) -> float:
    return sum(e - s for s, e in intervals)


def intersection_length(a: Sequence[Interval], b: Sequence[Interval]) -> float:
    """Length of the intersection of two merged (sorted, disjoint) interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def subtract(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """``a`` less ``b``, both merged lists."""
    out: list[Interval] = []
    j = 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k, cur = j, s
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


# -- events -------------------------------------------------------------------------------


def load_trace(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def is_nccl(name: str) -> bool:
    return "nccl" in name.lower()


def kernels(events: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e.get("cat") == "kernel" and e.get("ph", "X") == "X" and "dur" in e]


def gpu_busy_us(events: Sequence[dict[str, Any]]) -> float | None:
    """Microseconds in which at least one GPU kernel ran (``None``: the trace has no kernel)."""
    ks = kernels(events)
    return length(merge(_span(k) for k in ks)) if ks else None


def _span(e: dict[str, Any]) -> Interval:
    return float(e["ts"]), float(e["ts"]) + float(e["dur"])


def ranges(events: Sequence[dict[str, Any]], name: str) -> list[Interval]:
    """The CPU ``record_function`` ranges called ``name``, by start."""
    return sorted(
        _span(e) for e in events if e.get("cat") == "user_annotation" and e.get("name") == name and "dur" in e
    )


def launch_times(events: Sequence[dict[str, Any]]) -> dict[Any, float]:
    """Correlation id -> when the CPU launched that kernel."""
    return {
        e["args"]["correlation"]: float(e["ts"])
        for e in events
        if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})
    }


def launched_at(kernel: dict[str, Any], launch: dict[Any, float]) -> float:
    return launch.get(kernel.get("args", {}).get("correlation"), math.nan)


def timeline(compute: Iterable[Interval], comm: Iterable[tuple[float, float, str]]) -> dict[str, Any]:
    """``{"compute": [[s, e]], "nccl": [[s, e, label]]}`` in ms from the first of them (what
    the timeline plot draws)."""
    compute, comm = merge(compute), sorted(comm)
    starts = [s for s, _ in compute] + [c[0] for c in comm]
    t0 = min(starts) if starts else 0.0
    return {
        "compute": [[round((s - t0) / 1e3, 4), round((e - t0) / 1e3, 4)] for s, e in compute],
        "nccl": [[round((s - t0) / 1e3, 4), round((e - t0) / 1e3, 4), label] for s, e, label in comm],
    }


# -- collectives ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective as the trace shows it: a NCCL kernel, or a gloo range on the host."""

    start: float
    end: float
    issued: float
    """When the CPU issued it (the kernel's launch; a gloo range's start)."""
    kind: str
    """``all_reduce``, ``all_gather``, ``reduce_scatter``, ``broadcast`` or the name as found."""
    nbytes: int | None
    """What this rank put in (elements x dtype size); ``None`` when the trace does not say."""


def kind_of(name: str) -> str:
    flat = re.sub(r"[^a-z]", "", name.lower())
    kinds = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
    return next((kind for kind in kinds if kind.replace("_", "") in flat), name)


def dtype_bytes(dtype: Any) -> int | None:
    if not isinstance(dtype, str):
        return None
    return _DTYPE_BYTES.get(re.sub(r"^(c10::|torch\.)|[ _]", "", dtype.lower()))


def _nbytes(nelems: Any, dtype: Any) -> int | None:
    size = dtype_bytes(dtype)
    return int(nelems) * size if isinstance(nelems, (int, float)) and nelems >= 0 and size else None


def collectives(events: Sequence[dict[str, Any]]) -> tuple[list[Collective], list[Interval], str]:
    """The collectives of a trace, the compute they could overlap (merged), and which kind of
    trace it was: ``"cuda"`` (NCCL kernels), ``"cpu"`` (gloo ranges) or ``"none"``."""
    ks = kernels(events)
    nccl = [k for k in ks if is_nccl(k.get("name", ""))]
    if nccl:
        compute = merge(_span(k) for k in ks if not is_nccl(k.get("name", "")))
        return _nccl_collectives(events, nccl), compute, "cuda"
    gloo = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("gloo:") and "dur" in e]
    if gloo:
        comm = [
            Collective(*_span(e), float(e["ts"]), kind_of(e["name"][5:]), _gloo_bytes(e.get("args", {}))) for e in gloo
        ]
        return sorted(comm, key=lambda c: c.start), _host_compute(events, {e.get("tid") for e in gloo}), "cpu"
    return [], [], "none"


def _nccl_collectives(events: Sequence[dict[str, Any]], nccl: list[dict[str, Any]]) -> list[Collective]:
    nccl = sorted(nccl, key=lambda k: float(k["ts"]))
    meta = [k.get("args", {}) for k in nccl]
    if not any("In msg nelems" in a for a in meta):
        # Older traces: the sizes are on the CPU-side record_param_comms ops, one per kernel
        # in issue order (NCCL runs a stream's kernels in that order).
        params = sorted(
            (
                e
                for e in events
                if e.get("name") == "record_param_comms"
                and e.get("args", {}).get("Collective name") not in (None, "wait", "barrier")
            ),
            key=lambda e: float(e["ts"]),
        )
        if len(params) == len(nccl):
            meta = [e["args"] for e in params]
    launch = launch_times(events)
    return [
        Collective(
            *_span(k),
            _issued(k, launch),
            kind_of(str(a.get("Collective name") or k["name"])),
            _nbytes(a.get("In msg nelems"), a.get("dtype")),
        )
        for k, a in zip(nccl, meta)
    ]


def _issued(kernel: dict[str, Any], launch: dict[Any, float]) -> float:
    t = launched_at(kernel, launch)
    return float(kernel["ts"]) if math.isnan(t) else t


def last_step_start(events: Sequence[dict[str, Any]], mark: str, kind: str) -> float | None:
    """Where the last profiled step's work starts: the last ``mark`` range on the host; on
    CUDA, the first kernel launched after it."""
    marks = ranges(events, mark)
    if not marks:
        return None
    lo = marks[-1][0]
    if kind != "cuda":
        return lo
    launch = launch_times(events)
    starts = [float(k["ts"]) for k in kernels(events) if _issued(k, launch) >= lo]
    return min(starts) if starts else None


def _gloo_bytes(args: dict[str, Any]) -> int | None:
    dims, types = args.get("Input Dims"), args.get("Input type")
    if not dims or not types or not isinstance(dims[0], list) or not all(isinstance(d, int) for d in dims[0]):
        return None
    return _nbytes(math.prod(dims[0]), types[0])


def _host_compute(events: Sequence[dict[str, Any]], comm_threads: set[Any]) -> list[Interval]:
    """What the training threads did outside communication: their events, less the time in
    c10d's ops (issuing a collective can block on gloo) and in waits."""
    mine = [
        e
        for e in events
        if e.get("ph") == "X"
        and "dur" in e
        and e.get("cat") in ("cpu_op", "user_annotation")
        and e.get("tid") not in comm_threads
    ]
    busy = merge(_span(e) for e in mine)
    return subtract(
        busy, merge(_span(e) for e in mine if e.get("cat") == "cpu_op" and _is_comm_op(str(e.get("name", ""))))
    )


def _is_comm_op(name: str) -> bool:
    return name.startswith(("c10d::", "_c10d_functional::", "c10d_functional::")) or "wait" in name.lower()


# -- buckets ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PlannedBucket:
    """A bucket of the report, and what its collective should look like in a trace."""

    graph_id: int
    index: int
    kind: str
    params: int
    grad_bytes: int
    wire_bytes: int


def planned_buckets(report: dict[str, Any]) -> list[PlannedBucket]:
    """The training graphs' buckets of a report dict, in the order a backward issues them
    (later graphs first, then bucket index)."""
    out = []
    for g in report.get("graphs", []):
        if g.get("variant"):
            continue
        for b in g.get("buckets") or []:
            collective = b.get("collective") or "all_reduce"
            wire = b.get("wire_bytes")
            out.append(
                PlannedBucket(
                    graph_id=g["graph_id"],
                    index=b["index"],
                    kind=kind_of(collective.split()[0]),
                    params=len(b["params"]),
                    grad_bytes=b["bytes"],
                    wire_bytes=b["bytes"] if wire is None else wire,
                )
            )
    return sorted(out, key=lambda b: (-b.graph_id, b.index))


def attribute(
    comm: Sequence[Collective], buckets: Sequence[PlannedBucket]
) -> tuple[dict[int, list[Collective]], list[Collective]]:
    """Each collective to the planned bucket it reduces (NOTE [collectives to buckets]):
    ``({bucket position: [collectives]}, [collectives matching no bucket])``."""
    groups: dict[tuple[str, int], list[int]] = {}
    for i, b in enumerate(buckets):
        groups.setdefault((b.kind, b.wire_bytes), []).append(i)
    seen: dict[tuple[str, int], int] = {}
    matched: dict[int, list[Collective]] = {i: [] for i in range(len(buckets))}
    other = []
    for c in sorted(comm, key=lambda c: c.start):
        key = (c.kind, c.nbytes)
        if c.nbytes is None or key not in groups:
            other.append(c)
            continue
        n = seen.get(key, 0)
        seen[key] = n + 1
        group = groups[key]
        matched[group[n % len(group)]].append(c)
    # A table read by several lookups is gathered once per lookup, each a part of its wire
    # bytes: all-gathers of no bucket's size go to the one gathered table left without any.
    gathers = [i for i, b in enumerate(buckets) if b.kind == "all_gather" and not matched[i]]
    if len(gathers) == 1:
        parts = {id(c): c for c in other if c.kind == "all_gather" and c.nbytes is not None}
        matched[gathers[0]] = list(parts.values())
        other = [c for c in other if id(c) not in parts]
    return matched, other


def comm_figures(comm: Sequence[Collective], compute: Sequence[Interval]) -> tuple[float, float]:
    """Microseconds of ``comm`` (their union) and of the part of it that overlapped ``compute``."""
    spans = merge((c.start, c.end) for c in comm)
    return length(spans), intersection_length(spans, compute)
