"""Per-graph, per-bucket compile statistics: ``bucketwise.report(compiled)``."""

from __future__ import annotations

import dataclasses
import os
import weakref
from typing import Any, Callable

import torch.distributed as dist

from ..distributed.at_exit import at_exit
from ..distributed.result import BucketStats, VariantStats
from . import first_step, job_stats
from .compile_times import (
    BREAKDOWN_FOOTER,
    BREAKDOWN_HEADER,
    POLLS_AFTER_COMPILE,
    CompileTimes,
    CompileTimesTracker,
    breakdown_row,
    sum_compile_times,
)
from .files import atomic_write_json
from .table import align

STATS_DIR_ENV = "BUCKETWISE_STATS_DIR"
SCHEMA_VERSION = 1

# Stats folder -> how many compiled objects of this process write into it (see write_rank_file).
_stats_slots: dict[str, int] = {}


@dataclasses.dataclass
class SegmentStats:
    """One compiled piece of a Dynamo graph; under ``split`` it carries one planned bucket."""

    index: int
    params: list[str]
    bytes: int
    op_count: int
    compile_seconds: float
    backend: str
    fell_back: bool = False
    reason: str | None = None
    phases: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def param_count(self) -> int:
        return len(self.params)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["param_count"] = self.param_count
        return d


@dataclasses.dataclass
class GraphStats:
    """One graph Dynamo handed to bucketwise."""

    graph_id: int
    compile_id: str
    strategy: str
    """Strategy applied to this graph (``split`` or ``none``)."""
    strategy_reason: str | None
    """Why the requested strategy was not applied, if it was not."""
    graph_break_reasons: list[str]
    """The graph break that ended this graph, with the user source line (as
    ``torch._dynamo.explain`` reports it); empty if the graph ended with its frame."""
    recompile: bool
    """This graph replaced an earlier compile of the same frame (a guard failed)."""
    op_count: int
    higher_order_ops: list[str]
    segments: list[SegmentStats]
    buckets: list[BucketStats] = dataclasses.field(default_factory=list)
    unused_params: list[str] = dataclasses.field(default_factory=list)
    recompile_reason: str | None = None
    """For a recompile: the guard that failed (as ``TORCH_LOGS=recompiles`` reports it)."""
    plan_source: str | None = None
    """Where the bucket plan came from: ``"predicted"`` (DDP's routine over the predicted
    gradient-ready order) or ``"reducer"`` (the reducer's buckets, already final)."""
    variant: str | None = None
    """``"no_sync"``: compiled for ``no_sync()`` steps (and, under ``fused``, steps of a
    ``join()`` where a rank has joined): no collectives in the graph; ``None``: the training
    graph."""
    compile_times: CompileTimes | None = None
    """Where this graph's compile seconds went (NOTE [compile-time breakdown])."""
    comm_hook: str | None = None
    """``fused``: the DDP comm hook the graph reproduces beyond torch's allreduce/fp16/bf16 ones
    (``powerSGD_hook (...)``, ``traceable comm hook <name>``)."""
    variants: list[VariantStats] = dataclasses.field(default_factory=list)
    """With ``comm_hook``: every compile of the graph, in order (the first is segment 0's)."""
    shared_blocks: dict[str, Any] | None = None
    """Identical blocks that share one compile (NOTE [one compile per block]): the module list,
    the block class, how many blocks, how many compiles, their seconds and the seconds saved;
    ``{"reason": ...}`` where the graph's blocks are not shared; ``None`` without blocks."""

    @property
    def later_variants(self) -> list[VariantStats]:
        return self.variants[1:]

    @property
    def compile_seconds(self) -> float:
        return sum(s.compile_seconds for s in self.segments) + sum(v.compile_seconds for v in self.later_variants)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["segments"] = [s.to_dict() for s in self.segments]
        d["buckets"] = [b.to_dict() for b in self.buckets]
        d["variants"] = [v.to_dict() for v in self.variants]
        d["compile_seconds"] = self.compile_seconds
        d["compile_times"] = self.compile_times.to_dict() if self.compile_times is not None else None
        return d


class Report:
    """Live statistics of one ``bucketwise.compile`` result; grows as graphs are compiled.

    ``alignment`` is read from DDP's reducer when asked for (it is known only once the reducer
    has rebuilt its buckets, after the first training iteration).
    """

    def __init__(self, *, target: str, strategy: str, backend: str) -> None:
        self.target = target
        self.strategy = strategy
        self.backend = backend
        self.graphs: list[GraphStats] = []
        self.cudagraphs: list[Any] = []
        """:class:`~bucketwise.cudagraphs.runner.CudaGraphStats` of every wrapped graph (live)."""
        self.notes: list[str] = []
        self.graph_runs = 0
        """Calls of this object's compiled graphs (the wrapper every graph is returned in counts)."""
        self.eager_calls: dict[str, int] = {}
        """Calls of the compiled object in which no compiled graph ran, by reason."""
        self._alignment_fn: Callable[[], dict[str, Any]] | None = None
        self._slot: tuple[str, int] | None = None
        self.compile_times = CompileTimesTracker()
        self.first_step = first_step.FirstStep()
        """The first call and its backward, timed (NOTE [first step])."""
        self._polls_left = 0

    # -- recording -------------------------------------------------------------------------

    def add_graph(self, graph: GraphStats) -> None:
        self.graphs.append(graph)
        self._polls_left = POLLS_AFTER_COMPILE
        self.write_rank_file()

    def after_call(self) -> None:
        """After each call of the compiled object: on the first calls after a compile, add
        torch's records of it to the report and rewrite the stats file if they changed it
        (NOTE [compile-time breakdown]); nothing afterwards."""
        if self._polls_left:
            self._polls_left -= 1
            if self.compile_times.refresh():
                self.write_rank_file()

    def add_cudagraph(self, stats: Any) -> None:
        self.cudagraphs.append(stats)

    def ran_eagerly(self, reason: str) -> bool:
        """Count a call that ran no compiled graph; True the first time for this reason.

        The rank file is rewritten at the 1st, 2nd, 4th, 8th, ... such call and at interpreter
        exit, not at every call."""
        count = self.eager_calls.get(reason, 0) + 1
        self.eager_calls[reason] = count
        if count & (count - 1) == 0:
            self.write_rank_file()
        else:
            _write_at_exit(self)
        return count == 1

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def set_alignment_source(self, fn: Callable[[], dict[str, Any]]) -> None:
        self._alignment_fn = fn

    # -- reading ---------------------------------------------------------------------------

    @property
    def alignment(self) -> float | None:
        return self.alignment_detail().get("alignment")

    def alignment_detail(self) -> dict[str, Any]:
        if self._alignment_fn is None:
            return {"alignment": None, "status": "not a DDP module"}
        return self._alignment_fn()

    @property
    def totals(self) -> dict[str, Any]:
        self.compile_times.refresh()
        return {
            "graphs": len(self.graphs),
            "graph_breaks": sum(len(g.graph_break_reasons) for g in self.graphs),
            "recompiles": sum(1 for g in self.graphs if g.recompile),
            "segments": sum(len(g.segments) for g in self.graphs),
            "fallbacks": sum(1 for g in self.graphs for s in [*g.segments, *g.later_variants] if s.fell_back),
            "compile_seconds": round(sum(g.compile_seconds for g in self.graphs), 6),
            "compile_times": sum_compile_times(g.compile_times for g in self.graphs),
            "first_step": self.first_step.summary(self.compile_times.compiled_within),
            "alignment": self.alignment,
            "eager_calls": sum(self.eager_calls.values()),
        }

    def to_dict(self) -> dict[str, Any]:
        rank, world = rank_and_world()
        return {
            "schema": SCHEMA_VERSION,
            "target": self.target,
            "strategy": self.strategy,
            "backend": self.backend,
            "rank": rank,
            "world_size": world,
            "totals": self.totals,
            "alignment": self.alignment_detail(),
            "graphs": [g.to_dict() for g in self.graphs],
            "cudagraphs": [c.to_dict() for c in self.cudagraphs],
            "eager_calls": dict(self.eager_calls),
            "eager_regions": eager_regions(self.graphs),
            "notes": list(self.notes),
        }

    def to_json(self, path: str | os.PathLike) -> None:
        atomic_write_json(path, self.to_dict())

    def table(self) -> str:
        return format_table(self.to_dict())

    def __repr__(self) -> str:
        t = self.totals
        return (
            f"Report(target={self.target!r}, strategy={self.strategy!r}, graphs={t['graphs']}, "
            f"segments={t['segments']}, compile_seconds={t['compile_seconds']:.2f}, alignment={t['alignment']})"
        )

    def write_rank_file(self) -> None:
        """``$BUCKETWISE_STATS_DIR/rank<R>.json``, written whole then renamed (never torn), and
        sent to rank 0 through the job's store (NOTE [job-wide stats]).

        The first compiled object of a process that writes into a stats folder owns
        ``rank<R>.json``; further ones (a second model, an eval copy) write
        ``obj<k>/rank<R>.json`` instead of overwriting it.
        """
        out_dir = os.environ.get(STATS_DIR_ENV)
        if not out_dir:
            return
        rank = rank_and_world()[0]
        key = os.path.abspath(out_dir)
        if self._slot is None or self._slot[0] != key:
            index = _stats_slots.get(key, 0)
            _stats_slots[key] = index + 1
            self._slot = (key, index)
        folder = out_dir if self._slot[1] == 0 else os.path.join(out_dir, f"obj{self._slot[1]}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{rank}.json")
        data = self.to_dict()
        atomic_write_json(path, data)
        job_stats.publish(out_dir, os.path.relpath(path, out_dir), data)


def rank_and_world() -> tuple[int, int]:
    """This process's rank and world size; torchrun's ``RANK``/``WORLD_SIZE`` without a process
    group (after ``destroy_process_group()``: the writes at exit)."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


_unwritten: "weakref.WeakSet[Report]" = weakref.WeakSet()


def _write_at_exit(report: Report) -> None:
    at_exit("reports", _write_unwritten)
    _unwritten.add(report)


def _write_unwritten() -> None:
    for report in list(_unwritten):
        report.write_rank_file()
    _unwritten.clear()


def _graph_label(g: dict[str, Any]) -> str:
    """A graph's id, with its variant when it is not the training graph (``1 (no_sync)``)."""
    return f"{g['graph_id']} ({g['variant']})" if g.get("variant") else str(g["graph_id"])


def format_table(data: dict[str, Any]) -> str:
    """Aligned text table of one rank's report dict (also used by ``bucketwise stats``)."""
    header = ("graph", "seg", "params", "MiB", "ops", "compile s", "backend", "fallback")
    rows = []
    for g in data["graphs"]:
        for s in g["segments"]:
            rows.append(
                (
                    _graph_label(g),
                    str(s["index"]),
                    str(s["param_count"]),
                    f"{s['bytes'] / 2**20:.2f}",
                    str(s["op_count"]),
                    f"{s['compile_seconds']:.2f}",
                    s["backend"],
                    (s["reason"] or "yes")[:60] if s["fell_back"] else "-",
                )
            )
    lines = [_align([header, *rows])]
    lines.extend(bucket_table(data["graphs"]))
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
        for c in data.get("cudagraphs", [])
    ]
    if cg_rows:
        lines.append("")
        lines.append(
            _align(
                [("cuda graph", "captured", "replays", "records", "uncaptured", "pool MiB", "reason"), *cg_rows],
                right=range(2, 6),
            )
        )
    t = data["totals"]
    align = t["alignment"]
    lines.append(
        f"graphs {t['graphs']}, graph breaks {t['graph_breaks']}, recompiles {t['recompiles']}, "
        f"segments {t['segments']}, compile {t['compile_seconds']:.2f} s, "
        f"alignment {'n/a' if align is None else f'{align:.2f}'}"
        + (f" ({data['alignment'].get('status')})" if align is None and data.get("alignment") else "")
    )
    for g in data["graphs"]:
        if g["strategy_reason"]:
            lines.append(f"graph {g['graph_id']}: {g['strategy']} ({g['strategy_reason']})")
        for r in g["graph_break_reasons"]:
            lines.append(f"graph {g['graph_id']}: ended by graph break: {_short_reason(r)}")
        if g.get("recompile_reason"):
            lines.append(f"graph {g['graph_id']}: recompile, guard failed: {g['recompile_reason'][:200]}")
        for v in g.get("variants", [])[1:]:
            fell = f", fell back to eager: {(v['reason'] or '')[:80]}" if v["fell_back"] else ""
            lines.append(f"graph {g['graph_id']}: compiled again for {v['name']}, {v['compile_seconds']:.2f} s{fell}")
    lines.extend(f"ran eagerly: {n} call(s): {why}" for why, n in data.get("eager_calls", {}).items())
    lines.extend(f"runs eagerly between graphs: {r}" for r in data.get("eager_regions", []))
    lines.extend(f"note: {n}" for n in data.get("notes", []))
    lines.extend(shared_block_lines(data["graphs"]))
    times_rows = [
        breakdown_row(str(g["graph_id"]), g["compile_times"]) for g in data["graphs"] if g.get("compile_times")
    ]
    if times_rows:
        lines.append("")
        lines.append(_align([BREAKDOWN_HEADER, *times_rows], right=range(1, 8)))
        lines.append(BREAKDOWN_FOOTER)
    first = first_step.describe(data["totals"].get("first_step"))
    if first:
        lines.append(first)
    return "\n".join(lines)


def eager_regions(graphs: list[GraphStats]) -> list[str]:
    """Code Dynamo leaves to run eagerly between graphs on purpose: ``torch.compiler.disable``d
    functions and skipped frames, from the graph breaks that name them (once each)."""
    out: list[str] = []
    for g in graphs:
        for r in g.graph_break_reasons:
            head = r.lower()
            if "disable" in head or "skip" in head:
                short = _short_reason(r)
                if short not in out:
                    out.append(short)
    return out


def shared_block_lines(graphs: list[dict[str, Any]]) -> list[str]:
    """One line per graph whose blocks share a compile, or could not (NOTE [one compile per block])."""
    lines = []
    for g in graphs:
        shared = g.get("shared_blocks")
        if not shared:
            continue
        if "reason" in shared:
            lines.append(f"graph {_graph_label(g)}: blocks compiled with the whole graph: {shared['reason']}")
            continue
        lines.append(
            f"graph {_graph_label(g)}: {shared['count']} blocks of {shared['blocks']} ({shared['class']}) share "
            f"{shared['compiles']} compile{'s' if shared['compiles'] != 1 else ''} ({shared['compile_seconds']:.2f} s; "
            f"about {shared['saved_seconds']:.1f} s of compiles saved)"
        )
    return lines


def bucket_table(graphs: list[dict[str, Any]]) -> list[str]:
    """The fused buckets of ``graphs`` (report dicts): where each collective is issued, what it
    is and the bytes each rank sends into it; with comm hooks, the total against the gradient
    bytes (also used by ``bucketwise stats``). Empty without fused buckets."""
    rows = [
        (
            str(g["graph_id"]),
            str(b["index"]),
            str(len(b["params"])),
            f"{b['bytes'] / 2**20:.2f}",
            f"{b['issued_at']:.2f}",
            b.get("comm_dtype") or "-",
            b.get("collective") or "all_reduce",
            "-" if b.get("wire_bytes") is None else f"{b['wire_bytes'] / 2**20:.2f}",
        )
        for g in graphs
        for b in g.get("buckets", [])
        if b.get("issued_at") is not None
    ]
    if not rows:
        return []
    header = ("graph", "bucket", "params", "MiB", "issued at", "comm dtype", "collective", "wire MiB")
    return [
        "",
        _align([header, *rows], right=(0, 1, 2, 3, 4, 7)),
        "issued at: fraction of the backward done when the bucket's collective starts; "
        "wire MiB: what each rank sends into it",
        *wire_lines(graphs),
    ]


def wire_lines(graphs: list[dict[str, Any]]) -> list[str]:
    """Per fused graph that sends other than its gradient bytes (a comm hook, a compressed wire
    dtype, embedding rows): what its buckets send per step, against the gradient bytes."""
    lines = []
    for g in graphs:
        hook = g.get("comm_hook")
        buckets = [b for b in g.get("buckets") or [] if b.get("issued_at") is not None]
        grads = sum(b["bytes"] for b in buckets)
        known = [b["wire_bytes"] for b in buckets if b.get("wire_bytes") is not None]
        complete = len(known) == len(buckets) and grads > 0
        if not buckets or not (hook or complete and sum(known) != grads):
            continue
        line = f"graph {g['graph_id']}: " + (hook or "fused")
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


def _short_reason(reason: str, limit: int = 160) -> str:
    """First sentence of a Dynamo graph-break reason, plus its ``(at file:line)`` suffix."""
    where = reason[reason.rfind(" (at ") :] if reason.endswith(")") and " (at " in reason else ""
    head = reason[: len(reason) - len(where)].split(" Explanation:")[0].split(" Hint:")[0]
    if len(head) > limit:
        head = head[: limit - 3] + "..."
    return head + where


def _align(rows: list[tuple[str, ...]], right: Any = range(6)) -> str:
    return align(rows, right=right)


WRAPPER_ATTRS = ("_orig_mod", "module", "_forward_module", "_original_module")
"""Where a wrapper keeps what it wraps: ``torch.compile``'s ``OptimizedModule`` and
``CompiledModule`` (``_orig_mod``), DDP (``module``), Lightning Fabric's ``_FabricModule``
(``_forward_module``, ``_original_module``)."""


def report(compiled: Any) -> Report:
    """The :class:`Report` of what bucketwise compiled, found through the object you hold.

    Accepts what :func:`bucketwise.compile` returned, what ``torch.compile(...,
    backend="bucketwise")`` returned (once it has run a step: the backend attaches at the first
    call), the DDP module, the module compiled inside DDP, and the wrappers frameworks put
    around them (Lightning Fabric's module, accelerate's and the HF Trainer's DDP module).
    NOTE [report finds the compile]: each object is searched, wrapper by wrapper, through the
    attributes in :data:`WRAPPER_ATTRS` (read from the instance, never through a wrapper's own
    ``__getattr__``), for bucketwise's report or the record that the ``"bucketwise"`` backend
    left on a DDP module and on the module it wraps (``_compat/ddp.set_owner``).
    """
    seen: list[Any] = []
    todo = [compiled]
    while todo:
        node = todo.pop(0)
        if any(node is s for s in seen) or len(seen) >= 16:
            continue
        seen.append(node)
        attrs = getattr(node, "__dict__", None) or {}
        for candidate in (node, attrs.get("_bucketwise_compiled")):
            fields = getattr(candidate, "__dict__", None) or {}
            rep = fields.get("_bucketwise_report", fields.get("report"))
            if isinstance(rep, Report):
                return rep
        children = attrs.get("_modules") or {}
        todo += [w for name in WRAPPER_ATTRS for w in (children.get(name), attrs.get(name)) if w is not None]
    chain = " -> ".join(dict.fromkeys(type(s).__name__ for s in seen))
    raise TypeError(
        f"report() expects an object compiled by bucketwise, got {type(compiled).__name__} (searched: {chain}); "
        "pass what bucketwise.compile returned, the DDP module, or what torch.compile(..., backend='bucketwise') "
        "returned after its first call"
    )
