"""A report as text: ``report.table()``, ``bucketwise stats`` and its parts, from :class:`ReportData`."""

from __future__ import annotations

from typing import Sequence

from . import bytecode, first_step
from .compile_times import BREAKDOWN_FOOTER, BREAKDOWN_HEADER, breakdown_row
from .report_data import GraphData, ReportData
from .table import align


def format_table(data: ReportData) -> str:
    """Aligned text table of one rank's report."""
    header = ("graph", "seg", "params", "MiB", "ops", "fwd compile s", "backend", "fallback")
    rows = [
        (
            g.label,
            str(s.index),
            str(len(s.params)),
            f"{s.bytes / 2**20:.2f}",
            str(s.op_count),
            f"{s.compile_seconds:.2f}",
            s.backend,
            (s.reason or "yes")[:60] if s.fell_back else "-",
        )
        for g in data.graphs
        for s in g.segments
    ]
    lines = [align([header, *rows], right=range(6))]
    lines.extend(bucket_table(data.graphs))
    cg_rows = [
        (
            c["name"],
            "yes" if c["captured"] else "no",
            str(c["replays"]),
            str(c["records"]),
            str(c["uncaptured_runs"]),
            f"{c['pool_bytes'] / 2**20:.1f}",
            (c["reason"] or c.get("note") or "-")[:70],
        )
        for c in data.cudagraphs
    ]
    if cg_rows:
        lines.append("")
        lines.append(
            align(
                [("cuda graph", "captured", "replays", "records", "uncaptured", "pool MiB", "reason"), *cg_rows],
                right=range(2, 6),
            )
        )
    t = data.totals
    alignment = t["alignment"]
    times_rows = [breakdown_row(str(g.graph_id), g.compile_times) for g in data.graphs if g.compile_times]
    lines.append(
        f"graphs {t['graphs']}, graph breaks {t['graph_breaks']}, recompiles {t['recompiles']}, "
        f"segments {t['segments']}, {compile_text(t, breakdown=bool(times_rows))}, "
        f"alignment {'n/a' if alignment is None else f'{alignment:.2f}'}"
        + (f" ({data.alignment.get('status')})" if alignment is None and data.alignment else "")
    )
    for g in data.graphs:
        if g.strategy_reason:
            lines.append(f"graph {g.graph_id}: {g.strategy} ({g.strategy_reason})")
        for r in g.graph_break_reasons:
            lines.append(f"graph {g.graph_id}: ended by graph break: {short_reason(r)}")
        if g.recompile_reason:
            lines.append(f"graph {g.graph_id}: recompile, guard failed: {g.recompile_reason[:200]}")
        for v in g.later_compiles:
            fell = f", fell back to eager: {(v['reason'] or '')[:80]}" if v["fell_back"] else ""
            lines.append(f"graph {g.graph_id}: compiled again for {v['name']}, {v['compile_seconds']:.2f} s{fell}")
    lines.extend(f"ran eagerly: {n} call(s): {why}" for why, n in data.eager_calls.items())
    lines.extend(f"runs eagerly between graphs: {r}" for r in data.eager_regions)
    lines.extend(f"note: {n}" for n in data.notes)
    lines.extend(shared_block_lines(data.graphs, said=data.notes))
    if times_rows:
        lines.append("")
        lines.append(align([BREAKDOWN_HEADER, *times_rows], right=range(1, 8)))
        lines.append(BREAKDOWN_FOOTER)
    first = first_step.describe(t.get("first_step"))
    if first:
        lines.append(first)
    if t.get("python_bytecode") == bytecode.BytecodeState.EVERY_PROCESS.value:
        lines.append(
            "python bytecode: torch's modules are compiled from source in every process, in its start "
            "and first step (NOTE [compiled bytecode]; bucketwise.compile's warning names the fix)"
        )
    return "\n".join(lines)


def compile_seconds(totals: dict) -> float:
    """Every phase of every graph (NOTE [compile-time breakdown]), else the segments' compiles."""
    total = (totals.get("compile_times") or {}).get("total_s")
    return total if total else totals["compile_seconds"]  # 0: no graph has a breakdown


def compile_text(totals: dict, *, breakdown: bool) -> str:
    """The phases' total, not the ``fwd compile s`` column (no Dynamo, no lazy backward compile)."""
    if not breakdown:
        return f"compile {totals['compile_seconds']:.2f} s"
    return f"compile {compile_seconds(totals):.2f} s (every phase: the table below)"


def shared_block_lines(graphs: Sequence[GraphData], *, said: Sequence[str] = ()) -> list[str]:
    """One line per graph whose blocks share a compile, and one per reason blocks could not
    (naming its graphs) unless a note in ``said`` gives it (NOTE [one compile per block])."""
    lines = []
    unshared: dict[str, list[str]] = {}
    for g in graphs:
        shared = g.shared_blocks
        if not shared:
            continue
        if "reason" in shared:
            unshared.setdefault(shared["reason"], []).append(str(g.label))
            continue
        lines.append(
            f"graph {g.label}: {shared['count']} blocks of {shared['blocks']} ({shared['class']}) share "
            f"{shared['compiles']} compile{'s' if shared['compiles'] != 1 else ''} ({shared['compile_seconds']:.2f} s; "
            f"about {shared['saved_seconds']:.1f} s of compiles saved)"
            + _dynamo_calls(shared)
            + _bucket_per_block(shared)
        )
    for reason, labels in unshared.items():
        if not any(reason in note for note in said):
            graph = "graph" if len(labels) == 1 else "graphs"
            lines.append(f"{graph} {', '.join(labels)}: blocks compiled with the whole graph: {reason}")
    return lines


def _dynamo_calls(shared: dict) -> str:
    """Whether Dynamo met each shared block as one call (NOTE [Dynamo calls a block])."""
    return _status(shared.get("dynamo_calls"), "Dynamo traced each as one call", "Dynamo traced every block")


def _bucket_per_block(shared: dict) -> str:
    """``fused``: whether each shared block reduces its own bucket (NOTE [a bucket per block])."""
    return _status(
        shared.get("bucket_per_block"),
        "each reduces its own parameters as one bucket",
        "their parameters are bucketed across blocks",
    )


def _status(value: bool | str | None, yes: str, no: str) -> str:
    """``; yes``, ``; no: why`` (``value`` a reason), or nothing (``None``: not applicable)."""
    if value is None:
        return ""
    return f"; {yes}" if value is True else f"; {no}: {value}"


def bucket_table(graphs: Sequence[GraphData]) -> list[str]:
    """Where each fused bucket's collective is issued, what it is and the bytes each rank sends."""
    rows = [
        (
            str(g.graph_id),
            str(b["index"]),
            str(len(b["params"])),
            f"{b['bytes'] / 2**20:.2f}",
            f"{b['issued_at']:.2f}",
            b.get("comm_dtype") or "-",
            b.get("collective") or "all_reduce",
            "-" if b.get("wire_bytes") is None else f"{b['wire_bytes'] / 2**20:.2f}",
        )
        for g in graphs
        for b in g.fused_buckets
    ]
    if not rows:
        return []
    header = ("graph", "bucket", "params", "MiB", "issued at", "comm dtype", "collective", "wire MiB")
    return [
        "",
        align([header, *rows], right=(0, 1, 2, 3, 4, 7)),
        "issued at: fraction of the backward done when the bucket's collective starts; "
        "wire MiB: what each rank sends into it",
        *wire_lines(graphs),
    ]


def wire_lines(graphs: Sequence[GraphData]) -> list[str]:
    """Per fused graph sending other than its gradient bytes (comm hook, wire dtype, rows)."""
    lines = []
    for g in graphs:
        hook = g.comm_hook
        buckets = g.fused_buckets
        grads = sum(b["bytes"] for b in buckets)
        known = [b["wire_bytes"] for b in buckets if b.get("wire_bytes") is not None]
        complete = len(known) == len(buckets) and grads > 0
        if not buckets or not (hook or complete and sum(known) != grads):
            continue
        line = f"graph {g.graph_id}: " + (hook or "fused")
        if complete:
            wire = sum(known)
            line += (
                f": {wire / 2**20:.3f} MiB on the wire per step for {grads / 2**20:.3f} MiB of gradients "
                f"({wire / grads:.1%})"
            )
        if hook and hook.startswith("powerSGD_hook"):
            line += "; before start_powerSGD_iter each bucket is all-reduced whole"
        lines.append(line)
    return lines


def short_reason(reason: str, limit: int = 160) -> str:
    """First sentence of a Dynamo graph-break reason, plus its ``(at file:line)`` suffix."""
    where = reason[reason.rfind(" (at ") :] if reason.endswith(")") and " (at " in reason else ""
    head = reason[: len(reason) - len(where)].split(" Explanation:")[0].split(" Hint:")[0]
    if len(head) > limit:
        head = head[: limit - 3] + "..."
    return head + where
