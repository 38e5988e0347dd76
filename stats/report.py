"""Per-graph, per-bucket compile statistics: ``bucketwise.report(compiled)``."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

from ..distributed.result import BucketStats, VariantStats
from . import bytecode, first_step
from .compile_times import POLLS_AFTER_COMPILE, CompileTimes, CompileTimesTracker, sum_compile_times
from .files import atomic_write_json
from .rank_file import RankFile, rank_and_world
from .report_data import SCHEMA_VERSION, ReportData
from .report_format import format_table, short_reason


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
        self.unshared_blocks: dict[str, dict[str, Any]] = {}
        """Repeated blocks compiled with the whole graph where ``share_blocks`` could have shared
        them, by their container (:meth:`blocks_unshared`)."""
        self.graph_runs = 0
        """Calls of this object's compiled graphs (the wrapper every graph is returned in counts)."""
        self.eager_calls: dict[str, int] = {}
        """Calls of the compiled object in which no compiled graph ran, by reason."""
        self._alignment_fn: Callable[[], dict[str, Any]] | None = None
        self.rank_file = RankFile()
        """Where and when this report is written (``rank_file.py``)."""
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
        self.rank_file.eager_call(self, count)
        return count == 1

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def blocks_unshared(self, container: str, count: int, *, reason: str, host_time: bool) -> None:
        """``count`` repeated blocks of ``container`` compiled with the whole graph, and why, as a
        note and in ``unshared_blocks``; ``host_time``: only for the host time each shared block's
        call would cost (``share_blocks="auto"`` without CUDA graphs), which the runtime view
        weighs against a profiled step (NOTE [saying when sharing blocks is free])."""
        self.unshared_blocks[container] = {
            "container": container,
            "blocks": count,
            "reason": reason,
            "host_time": host_time,
        }
        self.note(f"{container}: {count} blocks compiled with the whole graph: {reason}")

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
            "python_bytecode": bytecode.torch_bytecode().state.value,
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
            "unshared_blocks": list(self.unshared_blocks.values()),
        }

    def data(self) -> ReportData:
        """What the report holds now, as readers of its file see it."""
        return ReportData.from_dict(self.to_dict())

    def to_json(self, path: str | os.PathLike) -> None:
        atomic_write_json(path, self.to_dict())

    def table(self) -> str:
        return format_table(self.data())

    def __repr__(self) -> str:
        t = self.totals
        return (
            f"Report(target={self.target!r}, strategy={self.strategy!r}, graphs={t['graphs']}, "
            f"segments={t['segments']}, compile_seconds={t['compile_seconds']:.2f}, alignment={t['alignment']})"
        )

    def write_rank_file(self) -> None:
        """Write ``$BUCKETWISE_STATS_DIR/rank<R>.json`` now (``rank_file.py``)."""
        self.rank_file.write(self)


def eager_regions(graphs: list[GraphStats]) -> list[str]:
    """Code Dynamo leaves to run eagerly between graphs on purpose: ``torch.compiler.disable``d
    functions and skipped frames, from the graph breaks that name them (once each)."""
    out: list[str] = []
    for g in graphs:
        for r in g.graph_break_reasons:
            head = r.lower()
            if "disable" in head or "skip" in head:
                short = short_reason(r)
                if short not in out:
                    out.append(short)
    return out


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
