"""A report as data: what one rank's ``rank<R>.json`` holds, read back with :meth:`ReportData.from_dict`.

``Report.to_dict()`` is the JSON schema (``SCHEMA_VERSION``). Every reader of a report reads a
:class:`ReportData`, so the schema is checked once (``from_dict`` names what is wrong) and readers
use fields, not keys. ``to_dict`` gives back exactly the dict it was made from.
"""

from __future__ import annotations

import dataclasses
from typing import Any

SCHEMA_VERSION = 1
_REQUIRED = ("rank", "world_size", "totals", "graphs")
_TOTALS_KEYS = ("graphs", "graph_breaks", "recompiles", "segments", "fallbacks", "compile_seconds")
_SEGMENT_KEYS = ("index", "params", "bytes", "op_count", "compile_seconds", "backend", "fell_back")


@dataclasses.dataclass(frozen=True)
class SegmentData:
    """One compiled piece of a graph (under ``split``, one planned bucket)."""

    index: int
    params: tuple[str, ...]
    bytes: int
    op_count: int
    compile_seconds: float
    backend: str
    fell_back: bool
    reason: str | None

    @classmethod
    def from_dict(cls, d: Any, graph_id: Any) -> SegmentData:
        if not isinstance(d, dict) or any(k not in d for k in _SEGMENT_KEYS):
            raise ValueError(f"malformed segment in graph {graph_id}")
        return cls(
            index=d["index"],
            params=tuple(d["params"]),
            bytes=d["bytes"],
            op_count=d["op_count"],
            compile_seconds=d["compile_seconds"],
            backend=d["backend"],
            fell_back=bool(d["fell_back"]),
            reason=d.get("reason"),
        )


@dataclasses.dataclass(frozen=True)
class GraphData:
    """One graph Dynamo handed to bucketwise, as the report records it."""

    graph_id: int
    strategy: str | None
    strategy_reason: str | None
    graph_break_reasons: tuple[str, ...]
    recompile_reason: str | None
    variant: str | None
    """``"no_sync"`` for the graph compiled for ``no_sync()`` steps; ``None``: the training graph."""
    segments: tuple[SegmentData, ...]
    buckets: tuple[dict[str, Any], ...]
    """Planned buckets as the JSON has them (``issued_at`` set for ``fused``'s collectives)."""
    compile_times: dict[str, Any] | None
    comm_hook: str | None
    later_compiles: tuple[dict[str, Any], ...]
    """With a comm hook: the compiles after the first (each ``name``, ``compile_seconds``,
    ``fell_back``, ``reason``)."""
    shared_blocks: dict[str, Any] | None

    @property
    def label(self) -> str:
        """The graph's id, with its variant when it is not the training graph (``1 (no_sync)``)."""
        return f"{self.graph_id} ({self.variant})" if self.variant else str(self.graph_id)

    @property
    def fused_buckets(self) -> list[dict[str, Any]]:
        """Buckets whose collective runs inside the compiled backward (``fused``)."""
        return [b for b in self.buckets if b.get("issued_at") is not None]

    @classmethod
    def from_dict(cls, d: Any) -> GraphData:
        if not isinstance(d, dict) or "graph_id" not in d or not isinstance(d.get("segments"), list):
            raise ValueError("malformed graph entry")
        gid = d["graph_id"]
        times = d.get("compile_times")
        return cls(
            graph_id=gid,
            strategy=d.get("strategy"),
            strategy_reason=d.get("strategy_reason"),
            graph_break_reasons=tuple(d.get("graph_break_reasons") or ()),
            recompile_reason=d.get("recompile_reason"),
            variant=d.get("variant"),
            segments=tuple(SegmentData.from_dict(s, gid) for s in d["segments"]),
            buckets=tuple(b for b in d.get("buckets") or () if isinstance(b, dict)),
            compile_times=times if isinstance(times, dict) else None,
            comm_hook=d.get("comm_hook"),
            later_compiles=tuple(d.get("variants") or ())[1:],
            shared_blocks=d.get("shared_blocks") or None,
        )


@dataclasses.dataclass(frozen=True)
class ReportData:
    """One rank's report."""

    rank: int
    world_size: int
    target: str | None
    strategy: str | None
    backend: str | None
    totals: dict[str, Any]
    alignment: dict[str, Any]
    graphs: tuple[GraphData, ...]
    cudagraphs: tuple[dict[str, Any], ...]
    eager_calls: dict[str, int]
    eager_regions: tuple[str, ...]
    notes: tuple[str, ...]
    source: dict[str, Any] = dataclasses.field(repr=False, compare=False)
    unshared_blocks: tuple[dict[str, Any], ...] = ()
    """Repeated blocks compiled with the whole graph, and why (``Report.blocks_unshared``)."""

    @classmethod
    def from_dict(cls, data: Any) -> ReportData:
        """``ValueError`` naming what is wrong when ``data`` is not a report."""
        if not isinstance(data, dict):
            raise ValueError("not a bucketwise report (top level is not an object)")
        missing = [k for k in _REQUIRED if k not in data]
        if missing:
            raise ValueError(f"not a bucketwise report (missing {', '.join(missing)})")
        if not isinstance(data["rank"], int) or not isinstance(data["world_size"], int):
            raise ValueError("not a bucketwise report ('rank' and 'world_size' must be integers)")
        if not isinstance(data["totals"], dict) or any(k not in data["totals"] for k in _TOTALS_KEYS):
            raise ValueError(f"not a bucketwise report ('totals' must hold {', '.join(_TOTALS_KEYS)})")
        if not isinstance(data["graphs"], list):
            raise ValueError("not a bucketwise report ('graphs' is not a list)")
        schema = data.get("schema", SCHEMA_VERSION)
        if schema != SCHEMA_VERSION:
            raise ValueError(f"report schema {schema!r}; this bucketwise reads schema {SCHEMA_VERSION}")
        return cls(
            rank=data["rank"],
            world_size=data["world_size"],
            target=data.get("target"),
            strategy=data.get("strategy"),
            backend=data.get("backend"),
            totals=data["totals"],
            alignment=data.get("alignment") or {},
            graphs=tuple(GraphData.from_dict(g) for g in data["graphs"]),
            cudagraphs=tuple(data.get("cudagraphs") or ()),
            eager_calls=dict(data.get("eager_calls") or {}),
            eager_regions=tuple(data.get("eager_regions") or ()),
            notes=tuple(data.get("notes") or ()),
            source=data,
            unshared_blocks=tuple(u for u in data.get("unshared_blocks") or () if isinstance(u, dict)),
        )

    def to_dict(self) -> dict[str, Any]:
        """The dict this was read from (the JSON schema)."""
        return self.source
