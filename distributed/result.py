"""What a strategy takes and returns; :class:`BucketStats` and :class:`VariantStats` are JSON schema."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ContextManager, Protocol, Sequence

import torch.fx as fx

from .._compat import dynamo as dc
from ..partitioners.param_usage import GraphParam
from ..partitioners.split import Segment


@dataclasses.dataclass
class CompileOutcome:
    """What happened when one graph or segment was handed to the backend."""

    backend: str
    seconds: float = 0.0
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    """Compile-cache lookups and AOTAutograd compiles during it (``_compat/dynamo.compile_counters`` difference)."""
    fell_back: bool = False
    reason: str | None = None


@dataclasses.dataclass
class BucketStats:
    """One planned gradient bucket of a graph."""

    index: int
    """Gradient-ready order: bucket 0 is reduced first in the backward."""
    params: list[str]
    bytes: int
    segment: int | None
    """Segment holding every parameter of the bucket (``split``), ``None`` if none does."""
    issued_at: float | None = None
    """``fused``: where in the backward its allreduce is issued (fraction of backward nodes)."""
    comm_dtype: str | None = None
    """``fused``: dtype on the wire (``bfloat16`` with ``bf16_compress_hook``)."""
    collective: str | None = None
    """``fused``: ``all_reduce`` (the bucket), ``all_gather rows`` (an embedding table
    reduced as the rows each rank looked up, NOTE [embedding rows]), the all-reduces of a
    ``powerSGD_hook`` bucket (``all_reduce uncompressed + P + Q``), or ``traced hook <name>``."""
    wire_bytes: int | None = None
    """``fused``: bytes each rank puts into the collective(s) per step (in the wire dtype; with
    PowerSGD once it compresses, before ``start_powerSGD_iter`` it sends ``bytes``); ``None``
    where unknown (a traced user hook)."""
    wire_parts: dict[str, int] | None = None
    """``fused`` with PowerSGD: ``wire_bytes`` per all-reduce (``uncompressed``, ``P``, ``Q``)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class VariantStats:
    """One compile of a graph whose buckets a comm hook reduces (NOTE [powersgd in the graph])."""

    name: str
    compile_seconds: float
    backend: str
    fell_back: bool = False
    reason: str | None = None
    phases: dict[str, float] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(kw_only=True)
class StrategyResult:
    """One graph as a strategy compiled it."""

    fn: Callable[..., Any]
    """What Dynamo calls instead of the graph."""
    segments: list[Segment]
    outcomes: list[CompileOutcome]
    """One per segment, in order."""
    buckets: list[BucketStats]
    plan_source: str | None = None
    comm_hook: str | None = None
    variants: list[VariantStats] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    """For the report (each once)."""
    rank_check_s: float = 0.0
    """Seconds in cross-rank checks, waiting for the other ranks included."""


def graph_label(graph_id: int) -> str:
    """How the report, progress lines and CUDA-graph runners name a graph: ``graph 3``."""
    return f"graph {graph_id}"


@dataclasses.dataclass(frozen=True, eq=False)
class GraphJob:
    """One Dynamo graph for a strategy to compile."""

    gm: fx.GraphModule
    example_inputs: Sequence[Any]
    params: Sequence[GraphParam]
    """The DDP reducer parameters it reads (``partitioners.param_usage``)."""
    graph_id: int
    ddp: Any = None

    @property
    def label(self) -> str:
        return graph_label(self.graph_id)


class PieceCompiler(Protocol):
    """How a strategy compiles pieces (implemented in ``compiler/graph_backend.py``)."""

    def piece(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], *, label: str, what: str, tracing: Any = None
    ) -> tuple[Callable[..., Any], CompileOutcome]:
        """``label`` (``graph 3 segment 0``) names its CUDA graphs; ``what`` is the progress line."""
        ...

    def fused(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], *, label: str, what: str
    ) -> tuple[Callable[..., Any], CompileOutcome]:
        """Compile a fused graph: as :meth:`piece`, with Inductor's comm/compute reordering on."""
        ...

    def variant(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], *, label: str, later: bool
    ) -> tuple[Callable[..., Any], CompileOutcome]:
        """Compile a comm hook's variant of a fused graph; ``later``: after the first compile."""
        ...

    def step(self, what: str) -> ContextManager[None]:
        """A progress line around work that compiles several pieces."""
        ...


def falls_back(exc: BaseException, *, fallback: str, functorch_depth: int) -> bool:
    """Whether a failed compile may fall back instead of re-raising: not under
    ``fallback="raise"``, not for Dynamo's control flow, not when a torch.func level was left
    pushed (``functorch_depth``: the depth at the start; Dynamo's guards would trip)."""
    if fallback == "raise" or dc.is_dynamo_control_flow(exc):
        return False
    return dc.functorch_depth() == functorch_depth


def bucket_stats(
    index: int,
    bucket: Sequence[Any],
    seg_of: dict[str, int],
    issued_at: float | None = None,
    comm_dtype: str | None = None,
    collective: str | None = None,
    wire_bytes: int | None = None,
    wire_parts: dict[str, int] | None = None,
) -> BucketStats:
    """The report's record of a bucket (``seg_of``: parameter name -> segment index)."""
    segs = sorted({seg_of[p.name] for p in bucket if p.name in seg_of})
    return BucketStats(
        index=index,
        params=[p.name for p in bucket],
        bytes=sum(p.nbytes for p in bucket),
        segment=segs[0] if len(segs) == 1 else None,
        issued_at=issued_at,
        comm_dtype=comm_dtype,
        collective=collective,
        wire_bytes=wire_bytes,
        wire_parts=wire_parts,
    )


def op_count(gm: fx.GraphModule) -> int:
    """Operations of a graph (what the report calls ops)."""
    return sum(1 for n in gm.graph.nodes if n.op.startswith("call_"))
