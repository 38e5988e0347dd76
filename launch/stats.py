"""Reading and merging the per-rank report files of one run (``rank<R>.json``, ``Report.to_dict()``).

:func:`merge` makes the dict ``bucketwise stats --json`` prints. Sizes and fused buckets are the
reference rank's (the lowest present); ranks whose bucket plan differs from it are in
``plan_differences``; ``compile_times`` has each phase's slowest rank, cache lookups summed over ranks.
"""

from __future__ import annotations

import json
import os
import re
import statistics
from typing import Any, Callable, Iterable, Sequence

from ..stats.bytecode import COMPILE_ONCE, BytecodeState
from ..stats.compile_times import BREAKDOWN_FOOTER, BREAKDOWN_HEADER, breakdown_row
from ..stats.job_stats import rank_ranges
from ..stats.report_data import GraphData, ReportData, SegmentData
from ..stats.report_format import bucket_table, compile_seconds
from ..stats.runtime_view import GPU_BOUND_PREFIX, HOST_BOUND_PREFIX, RuntimeView, merged_table
from ..stats.table import align

MERGED_SCHEMA = 1
_RANK_FILE = re.compile(r"^rank(\d+)\.json$")
_RUNTIME_FILE = re.compile(r"^runtime-rank(\d+)\.json$")


class StatsError(Exception):
    """A path given to ``bucketwise stats`` holds nothing readable."""


def rank_files(path: str) -> list[str]:
    """The ``rank<R>.json`` files of a run folder, by rank; or ``[path]`` for a file."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise StatsError(f"{path}: no such file or folder")
    return _by_rank(path, _RANK_FILE)


def _by_rank(folder: str, pattern: re.Pattern[str]) -> list[str]:
    """The files of ``folder`` whose names match ``pattern`` (the rank its group), by rank."""
    found = [(m, os.path.join(folder, f)) for f in os.listdir(folder) if (m := pattern.match(f))]
    return [f for m, f in sorted(found, key=lambda mf: int(mf[0].group(1)))]


def load_rank_file(path: str) -> ReportData:
    """One rank's report; raises ``ValueError`` naming what is wrong with the file."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read it ({e.strerror or e})") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e})") from e
    return ReportData.from_dict(data)


def load_reports(path: str | Sequence[str], warn: Callable[[str], None]) -> list[ReportData]:
    """Every readable rank report under ``path`` (or several paths); ``warn`` names those skipped."""
    reports = []
    for f in [f for p in ([path] if isinstance(path, str) else path) for f in rank_files(p)]:
        try:
            reports.append(load_rank_file(f))
        except ValueError as e:
            warn(f"skipping {f}: {e}")
    by_rank: dict[int, ReportData] = {}
    for r in reports:
        if by_rank.setdefault(r.rank, r) is not r:
            warn(f"two files for rank {r.rank}; keeping the first")
    return [by_rank[k] for k in sorted(by_rank)]


# -- merging -------------------------------------------------------------------------------


def plan_of(report: ReportData) -> dict[tuple[int, str, int], tuple[str, ...]]:
    """``(graph_id, "segment" or "bucket", index) -> parameter names``; buckets where the file lists them."""
    plan = {}
    for g in report.graphs:
        for s in g.segments:
            plan[(g.graph_id, "segment", s.index)] = s.params
        for b in g.buckets:
            if "index" in b and isinstance(b.get("params"), list):
                plan[(g.graph_id, "bucket", b["index"])] = tuple(b["params"])
    return plan


def plan_differences(reports: list[ReportData]) -> list[dict[str, Any]]:
    """Where each rank's plan differs from the first rank's, per segment and bucket (``part``)."""
    ref = reports[0]
    ref_plan = plan_of(ref)
    diffs = []
    for other in reports[1:]:
        plan = plan_of(other)
        for key in sorted(set(ref_plan) | set(plan), key=lambda k: (k[0], k[1] != "segment", k[2])):
            a, b = ref_plan.get(key), plan.get(key)
            if a == b:
                continue
            if b is None:
                what = f"{key[1]} missing on rank {other.rank}"
            elif a is None:
                what = f"{key[1]} not on rank {ref.rank}"
            else:
                what = _describe_param_diff(a, b, ref.rank, other.rank)
            where = dict(zip(("graph_id", "part", "index"), key))
            diffs.append({"rank": other.rank, "reference_rank": ref.rank, **where, "difference": what})
    return diffs


def _describe_param_diff(a: tuple[str, ...], b: tuple[str, ...], ref_rank: int, rank: int) -> str:
    only = ((ref_rank, [p for p in a if p not in b]), (rank, [p for p in b if p not in a]))
    return (
        "; ".join(f"only on rank {r}: {_names(ps)}" for r, ps in only if ps) or "same parameters in a different order"
    )


def _names(names: list[str], limit: int = 4) -> str:
    return ", ".join(names[:limit]) + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def _segment_rows(reports: list[ReportData]) -> list[dict[str, Any]]:
    found: dict[tuple[int, int], list[tuple[int, SegmentData]]] = {}
    for rep in reports:
        for g in rep.graphs:
            for s in g.segments:
                found.setdefault((g.graph_id, s.index), []).append((rep.rank, s))
    rows = []
    for (graph_id, index), seen in sorted(found.items()):
        first = seen[0][1]
        times = {str(rank): s.compile_seconds for rank, s in seen}
        fell = [(rank, s.reason or "unknown reason") for rank, s in seen if s.fell_back]
        rows.append(
            {
                "graph_id": graph_id,
                "index": index,
                "params": len(first.params),
                "bytes": first.bytes,
                "op_count": first.op_count,
                "ranks": [rank for rank, _ in seen],
                "backends": list(dict.fromkeys(s.backend for _, s in seen)),
                "fallback_ranks": [rank for rank, _ in fell],
                "fallback_reasons": list(dict.fromkeys(reason for _, reason in fell)),
                "compile_seconds": {
                    "min": min(times.values()),
                    "median": statistics.median(times.values()),
                    "max": max(times.values()),
                    "per_rank": times,
                },
            }
        )
    return rows


def _compile_time_rows(reports: list[ReportData]) -> list[dict[str, Any]]:
    per_graph: dict[int, dict[str, dict[str, Any]]] = {}
    for rep in reports:
        for g in rep.graphs:
            if g.compile_times is not None:
                per_graph.setdefault(g.graph_id, {})[str(rep.rank)] = g.compile_times
    return [
        {
            "graph_id": gid,
            "ranks": [int(r) for r in ranks],
            "slowest": _slowest(list(ranks.values())),
            "per_rank": ranks,
        }
        for gid, ranks in sorted(per_graph.items())
    ]


def _slowest(times: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in times[0].items():
        values = [t.get(key) for t in times]
        if isinstance(value, dict):
            out[key] = {k: sum(v.get(k, 0) for v in values if isinstance(v, dict)) for k in value}
        elif all(isinstance(v, (int, float)) for v in values if v is not None) and any(v is not None for v in values):
            out[key] = max(v for v in values if v is not None)
        else:
            out[key] = value
    return out


def merge(reports: list[ReportData]) -> dict[str, Any]:
    """One dict for the whole run (see the module docstring)."""
    if not reports:
        raise StatsError("no rank reports to merge")
    ref = reports[0]
    ranks = [r.rank for r in reports]
    world = max(r.world_size for r in reports)
    graph_notes: list[str] = []
    for rep in reports:
        for g in rep.graphs:
            lines = [f"{g.strategy} ({g.strategy_reason})"] if g.strategy_reason else []
            lines += [f"after graph break: {r}" for r in g.graph_break_reasons]
            for line in lines:
                entry = f"graph {g.graph_id}: {line}"
                if entry not in graph_notes:
                    graph_notes.append(entry)
    return {
        "schema": MERGED_SCHEMA,
        "ranks": ranks,
        "world_size": world,
        "missing_ranks": [r for r in range(world) if r not in ranks],
        "target": ref.target,
        "strategy": ref.strategy,
        "backend": ref.backend,
        "segments": _segment_rows(reports),
        "plan_differences": plan_differences(reports),
        "compile_times": _compile_time_rows(reports),
        "totals": {str(r.rank): r.totals for r in reports},
        "alignment": {str(r.rank): r.totals.get("alignment") for r in reports},
        "graph_notes": graph_notes,
        "notes": list(dict.fromkeys(n for r in reports for n in r.notes)),
        "eager_calls": {str(r.rank): r.eager_calls for r in reports},
        "fused_buckets": fused_buckets(ref),
    }


def fused_buckets(report: ReportData) -> list[dict[str, Any]]:
    """The reference rank's fused buckets per graph (the fused layout check: every rank runs the same)."""
    return [
        {"graph_id": g.graph_id, "comm_hook": g.comm_hook, "buckets": g.fused_buckets}
        for g in report.graphs
        if g.fused_buckets
    ]


# -- text ----------------------------------------------------------------------------------


def format_merged(merged: dict[str, Any]) -> str:
    """The per-bucket table across ranks, a totals line and the plan check."""
    rows = [("graph", "seg", "params", "MiB", "ops", "fwd compile s min", "median", "max", "backend", "fallbacks")]
    n_ranks = len(merged["ranks"])
    for s in merged["segments"]:
        counts = [str(s[k]) for k in ("graph_id", "index", "params")]
        seconds = [f"{s['compile_seconds'][k]:.2f}" for k in ("min", "median", "max")]
        mib, backends = f"{s['bytes'] / 2**20:.2f}", "/".join(s["backends"])
        rows.append((*counts, mib, str(s["op_count"]), *seconds, backends, _fallback_cell(s, n_ranks)))
    lines = [align(rows, right=range(8))]  # backend and fallbacks left-aligned
    if merged.get("fused_buckets"):
        graphs = [GraphData.from_dict({**entry, "segments": []}) for entry in merged["fused_buckets"]]
        lines.extend(bucket_table(graphs))
        lines.append(f"(buckets as rank {merged['ranks'][0]} reports them)")
    lines.append(totals_line(merged))
    lines.extend(merged["graph_notes"])
    lines.extend(eager_lines(merged))
    lines.extend(f"note: {n}" for n in merged["notes"])
    lines.extend(plan_check_lines(merged))
    times = [breakdown_row(str(t["graph_id"]), t["slowest"]) for t in merged.get("compile_times", [])]
    if times:
        footer = BREAKDOWN_FOOTER + "; seconds: the slowest rank's, cache lookups: all ranks'"
        lines += ["", align([BREAKDOWN_HEADER, *times], right=range(1, 8)), footer]
    return "\n".join(lines)


def eager_lines(merged: dict[str, Any]) -> list[str]:
    """Calls that ran no compiled graph, one line per reason with the ranks and counts."""
    by_reason: dict[str, list[tuple[str, int]]] = {}
    for rank, calls in merged.get("eager_calls", {}).items():
        for reason, n in calls.items():
            by_reason.setdefault(reason, []).append((rank, n))
    return [
        f"{merged.get('target')} RAN EAGERLY on rank {','.join(r for r, _ in seen)} "
        f"({_span(n for _, n in seen)} call(s)): {reason}"
        for reason, seen in by_reason.items()
    ]


def eager_summary(stats_dir: str) -> list[str]:
    """:func:`eager_lines` of every compiled object of a run folder (``rank<R>.json``, ``obj<k>/``)."""
    folders = [stats_dir, *(os.path.join(stats_dir, d) for d in other_objects(stats_dir))]
    return [
        line for f in folders if (reports := load_reports(f, lambda msg: None)) for line in eager_lines(merge(reports))
    ]


def other_objects(stats_dir: str) -> list[str]:
    """The ``obj<k>`` folders of a run folder: compiled objects after the first of a process."""
    if not os.path.isdir(stats_dir):
        return []
    return sorted(d for d in os.listdir(stats_dir) if d.startswith("obj") and os.path.isdir(os.path.join(stats_dir, d)))


def _fallback_cell(segment: dict[str, Any], n_ranks: int) -> str:
    failed = segment["fallback_ranks"]
    if not failed:
        return "-"
    ranks = "all ranks" if len(failed) == n_ranks else "rank " + ",".join(map(str, failed))
    return f"{ranks}: {segment['fallback_reasons'][0]}"[:70]


def totals_line(merged: dict[str, Any]) -> str:
    """Run totals (ranges across ranks where they differ) and missing ranks."""
    totals = list(merged["totals"].values())
    compile_s = [compile_seconds(t) for t in totals]  # every phase, as the breakdown table
    aligns = sorted({a for a in merged["alignment"].values() if a is not None})
    align = f"{aligns[0]:.2f}" + (f"..{aligns[-1]:.2f} across ranks" if len(aligns) > 1 else "") if aligns else "n/a"
    line = (
        f"ranks {len(merged['ranks'])} of {merged['world_size']}, graphs {_span(t['graphs'] for t in totals)}, "
        f"graph breaks {_span(t['graph_breaks'] for t in totals)}, "
        f"recompiles {_span(t['recompiles'] for t in totals)}, "
        f"segments {_span(t['segments'] for t in totals)}, fallbacks {sum(t['fallbacks'] for t in totals)}, "
        f"compile {min(compile_s):.2f}..{max(compile_s):.2f} s per rank, alignment {align}"
    )
    if merged["missing_ranks"]:
        line += f"\nwarning: no report from rank(s) {', '.join(map(str, merged['missing_ranks']))}"
    uncached = [
        int(r) for r, t in merged["totals"].items() if t.get("python_bytecode") == BytecodeState.EVERY_PROCESS.value
    ]
    if uncached:
        line += (
            f"\nwarning: rank(s) {rank_ranges(uncached)} compiled torch's modules from source (no cached "
            "bytecode, and Python may not keep it), in their start and first step, as every restart will: "
            f"`{COMPILE_ONCE}` once fixes it (NOTE [compiled bytecode])"
        )
    return line


def _span(values: Iterable[int]) -> str:
    vals = sorted(set(values))
    return str(vals[0]) if len(vals) == 1 else f"{vals[0]}..{vals[-1]}"


# -- runtime views (bucketwise launch --profile-steps) ----------------------------------------


def runtime_views(path: str, warn: Callable[[str], None]) -> list[RuntimeView]:
    """The ``runtime-rank<R>.json`` views of a run folder, by rank; ``warn`` names those skipped."""
    if not os.path.isdir(path):
        return []
    views = []
    for f in _by_rank(path, _RUNTIME_FILE):
        try:
            with open(f) as fh:
                views.append(RuntimeView.from_dict(json.load(fh)))
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:  # AttributeError: JSON not an object
            warn(f"skipping {f}: not a runtime view ({type(e).__name__}: {e})")
    return views


def host_bound_lines(path: str, steps: int) -> list[str]:
    """``bucketwise doctor``'s verdict: the host-bound ranks' notes, else the GPU-bound ranks' advice."""
    views = runtime_views(path, lambda msg: None)
    if not views:
        return [
            f"bucketwise doctor: no step was profiled: the job ended within its warm-up, before {steps} profiled "
            "step(s) (--profile-warmup W sets the warm-up): nothing to say about host-bound steps"
        ]
    if lines := _rank_notes(views, HOST_BOUND_PREFIX):
        return lines
    measured = [v for v in views if v.gpu_busy_ms is not None]
    if not measured:
        return ["bucketwise doctor: no GPU kernels in the profiled steps: nothing to say about host-bound steps"]
    return [
        f"bucketwise doctor: the GPU was busy {min(v.gpu_busy_ms / v.step_ms for v in measured):.0%} or more of "
        "every profiled step: not bound by the host",
        *_rank_notes(views, GPU_BOUND_PREFIX),
    ]


def _rank_notes(views: list[RuntimeView], prefix: str) -> list[str]:
    return [f"bucketwise doctor: rank {v.rank}: {n}" for v in views for n in v.notes if n.startswith(prefix)]


def runtime_lines(path: str, warn: Callable[[str], None]) -> list[str]:
    """The per-bucket runtime table of every rank's view in a run folder; none without views."""
    views = runtime_views(path, warn)
    return ["", merged_table(views)] if views else []


def pointer_lines(stats_dir: str, job: dict[str, Any]) -> list[str]:
    """What a node other than rank 0's prints: its own ranks and where the whole table is."""
    at = job["gathered_by"]
    here = [int(_RANK_FILE.match(os.path.basename(f))[1]) for f in rank_files(stats_dir)]
    return [
        f"bucketwise: rank(s) {rank_ranges(here) or 'none'} of {job.get('world_size', '?')} "
        f"wrote their files into {stats_dir}",
        f"bucketwise: the job-wide table is printed by `bucketwise launch` on {at.get('host')}, the node that "
        f"ran rank 0, from {at.get('stats_dir')} (`bucketwise stats {at.get('stats_dir')}` prints it again)",
    ]


def plan_check_lines(merged: dict[str, Any]) -> list[str]:
    """Whether every rank's bucket plan equals the reference rank's; the differences if not."""
    diffs = merged["plan_differences"]
    if len(merged["ranks"]) < 2:
        return []
    if not diffs:
        return [f"bucket plans: identical on all {len(merged['ranks'])} ranks"]
    ranks = sorted({d["rank"] for d in diffs})
    lines = [f"bucket plans DIFFER from rank {diffs[0]['reference_rank']} on rank(s) {', '.join(map(str, ranks))}:"]
    lines += [f"  rank {d['rank']} graph {d['graph_id']} {d['part']} {d['index']}: {d['difference']}" for d in diffs]
    return lines
