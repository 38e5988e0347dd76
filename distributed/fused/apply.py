"""The fused strategy for one Dynamo graph: plan buckets, insert the collectives, compile whole."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Sequence

from ..._compat import collectives as cc
from ..._compat import ddp as ddpc
from ..._compat import ddp_hooks
from ..._compat import dynamo as dc
from ..._compat import inductor as ci
from ..._compat import mm_into_bucket as mib
from ...partitioners.param_usage import GraphParam, ready_order
from ...partitioners.split import Segment
from ..plan import BucketCaps, plan_buckets
from ..rank_check import check_same_on_all_ranks, gather_on_all_ranks
from ..result import CompileOutcome, GraphJob, PieceCompiler, StrategyResult, bucket_stats, op_count
from .cache_keys import comm_pass_key, source_key, traced_call_targets
from .comm_hooks import HookedGraph, HookProgram
from .embedding_rows import RowsSync, insert_embedding_rows, plan_embedding_rows, renormed_tables
from .hook_kinds import HookKind
from .runtime import FusedRuntime
from .sync import REDUCED_PARAMS_META, CommSpec, backward_positions, insert_bucket_syncs
from .variants import VariantCompiler

log = logging.getLogger(__name__)


@dataclasses.dataclass
class FusedState:
    """What one graph backend keeps across the graphs it compiles with ``fused``."""

    runtime: FusedRuntime
    checked_layouts: set[tuple[str, ...]] = dataclasses.field(default_factory=set)
    """Bucket layouts all ranks agreed on (NOTE [fused layout check])."""


@dataclasses.dataclass(frozen=True)
class Reduction:
    """One collective of a fused graph, for the report (``wire_bytes`` per rank and step)."""

    params: Sequence[GraphParam]
    collective: str
    wire_bytes: int | None
    parts: dict[str, int] | None = None


@dataclasses.dataclass(frozen=True)
class FusedPlan:
    """The buckets and gathered tables of one graph, as every rank agreed on them."""

    buckets: list[list[GraphParam]]
    tables: list[RowsSync]
    rank_check_s: float = 0.0
    """Seconds the layout check across ranks took (waiting for the other ranks included)."""
    in_blocks: frozenset[int] = frozenset()
    """Reducer indices of the parameters whose buckets shared blocks reduce (NOTE [a bucket per
    block]): no ``BucketSync`` for those."""


def fused_backend_options(user_options: dict[str, Any] | None, *, post_grad_pass: Any = None) -> dict[str, Any]:
    """Inductor options of fused compiles: NOTE [late waits], NOTE [block reductions grouped],
    NOTE [compile cache keys], NOTE [reductions into bucket views]. The user's options win."""
    ours = {**cc.comm_overlap_options(comm_pass_key()), **ci.bucket_safe_patches()}
    ours["post_grad_custom_post_pass"] = _with_products_into_buckets(post_grad_pass)
    return dc.cacheable_calls_options(traced_call_targets(), {**ours, **(user_options or {})})


def _with_products_into_buckets(first: Any) -> Any:
    """NOTE [matrix products into the bucket], after ``first`` (a post-grad pass or ``None``)."""

    def run(graph: Any) -> None:
        if first is not None:
            first(graph)
        mib.products_into_buckets(graph)

    return cc.post_grad_pass(run, f"{first.uuid() if first is not None else ''}-{source_key(mib)}")


def apply_fused(
    job: GraphJob,
    compiler: PieceCompiler,
    *,
    caps: BucketCaps,
    spec: CommSpec,
    comm_hook: HookKind,
    gather_rows: bool,
    rows_off: str | None = None,
    state: FusedState,
) -> StrategyResult:
    """The graph with its buckets' collectives traced into its backward, compiled whole
    (NOTE [one decision]). ``rows_off``: why rows are not gathered though the config asks."""
    program = _hook_program(job.ddp, spec, state.runtime, comm_hook)
    if program is not None:
        return _apply_hooked(job, compiler, caps=caps, state=state, program=program)
    plan = fused_plan(job, spec, caps, state, rows=gather_rows)
    notes = [rows_off] if rows_off is not None and plan_embedding_rows(job.gm, job.params, spec.world_size) else []
    # What each collective reduces, for the report: buckets, then the gathered tables (a
    # table's gather is issued after the gradient of its first use, its first lookup).
    reductions = [Reduction(b, "all_reduce", _wire_bytes(b, spec)) for b in plan.buckets] + [
        Reduction([t.param], "all_gather rows", t.wire_bytes(spec.comm_dtype)) for t in plan.tables
    ]
    gm = job.gm
    positions = backward_positions(gm, [r.params for r in reductions])
    # Rows first: each lookup is replaced in place (node positions unchanged), so the
    # buckets' first-use positions still hold for insert_bucket_syncs.
    insert_embedding_rows(gm, plan.tables, spec)
    insert_bucket_syncs(gm, [b for b in plan.buckets if b[0].reducer_index not in plan.in_blocks], spec)
    what = f"whole graph + {len(plan.buckets)} bucket allreduces" + (
        f" + {len(plan.tables)} row gathers" if plan.tables else ""
    )
    compiled, outcome = compiler.fused(gm, job.example_inputs, label=f"{job.label} segment 0", what=what)
    result = _result(job, spec, reductions, positions, compiled, outcome, state, plan.rank_check_s)
    result.notes = notes
    return result


def _apply_hooked(
    job: GraphJob, compiler: PieceCompiler, *, caps: BucketCaps, state: FusedState, program: HookProgram
) -> StrategyResult:
    """Compiled per variant; no embedding rows: the hook gets tables like any gradient, as in DDP."""
    spec = program.plain_spec()
    plan = fused_plan(job, spec, caps, state, rows=False)
    synced = [[p for p in b if p.first_use >= 0] for b in plan.buckets]
    synced = [b for b in synced if b]
    reductions = [Reduction(b, *program.wire(b)) for b in synced]
    positions = backward_positions(job.gm, synced)
    variants = VariantCompiler(job, program, synced, compiler)
    graph = HookedGraph(program, synced, variants)
    notes = []
    # Equal results with eager DDP need the reducer's buckets (NOTE [powersgd in the graph]).
    if not ddpc.will_rebuild(job.ddp):
        notes.append(
            f"{program.name}: DDP keeps its construction-time buckets (find_unused_parameters=True), "
            "the fused graphs reduce the planned ones: the hook sees other buckets than in eager DDP"
        )
    elif program.bucket_count() > len(synced):
        notes.append(
            f"{program.name}: several graphs reduce buckets, each its own: the hook sees other "
            "buckets (and indices) than DDP's reducer would give it in eager DDP"
        )
    with compiler.step(f"whole graph + {len(synced)} buckets ({program.describe()})"):
        graph.ensure(program.variant(graph))
    result = _result(job, spec, reductions, positions, graph, variants.first_outcome(), state, plan.rank_check_s)
    result.comm_hook, result.variants, result.notes = program.describe(), variants.variants, notes
    return result


def _result(
    job: GraphJob,
    spec: CommSpec,
    reductions: list[Reduction],
    positions: list[float | None],
    compiled: Callable[..., Any],
    outcome: CompileOutcome,
    state: FusedState,
    rank_check_s: float,
) -> StrategyResult:
    runtime = state.runtime
    key = runtime.graphs_compiled((id(p.tensor) for r in reductions for p in r.params), spec)
    used = [p for p in job.params if p.first_use >= 0]
    seg_of = {p.name: 0 for p in used}
    stats = [
        bucket_stats(i, r.params, seg_of, pos, spec.describe(), r.collective, r.wire_bytes, r.parts)
        for i, (r, pos) in enumerate(zip(reductions, positions))
    ]
    segment = Segment(index=0, submodule="", params=used, op_count=op_count(job.gm))
    placeholders = [n for n in job.gm.graph.nodes if n.op == "placeholder"]
    slot_of = {n: i for i, n in enumerate(placeholders)}
    param_slots = tuple(slot_of[p.node] for r in reductions for p in r.params if p.node in slot_of)
    return StrategyResult(
        fn=FusedRan(compiled, runtime, key, param_slots, job.example_inputs),
        segments=[segment],
        outcomes=[outcome],
        buckets=stats,
        plan_source="predicted",
        rank_check_s=rank_check_s,
    )


class FusedRan:
    """A fused graph that tells the runtime it ran, and on which parameters (see NOTE [fused
    strategy runtime]).

    Dynamo calls one compiled graph for every module its guards accept: a layer's forward
    compiled as a frame of its own (after a graph break) runs each layer's parameters through
    the graph compiled for the first. The graph reduces whichever parameters it is given, so
    each new set of them (told apart by the first) is recorded as the runtime's graph once.
    """

    def __init__(
        self, fn: Callable[..., Any], runtime: FusedRuntime, key: int, positions: tuple[int, ...], inputs: Sequence[Any]
    ) -> None:
        self.fn, self.runtime, self.positions = fn, runtime, positions
        self.first = positions[0] if positions else None
        """Where the graph's first reduced parameter comes in."""
        self.keys = {id(inputs[self.first]): key} if positions else {}
        """Runtime key per parameter set, by the id of its first parameter."""
        self.key = key

    def __call__(self, *args: Any) -> Any:
        if self.first is None:
            self.runtime.graph_ran(self.key)
            return self.fn(*args)
        key = self.keys.get(id(args[self.first]))
        if key is None:
            key = self.keys[id(args[self.first])] = self.runtime.graphs_compiled(
                (id(args[i]) for i in self.positions), self.runtime.spec
            )
        self.runtime.graph_ran(key)
        return self.fn(*args)


# -- comm hooks in the graph (comm_hooks.py) -----------------------------------------------


def _hook_program(ddp: Any, spec: CommSpec, runtime: FusedRuntime, kind: HookKind) -> HookProgram | None:
    """The comm hook's program, shared by the graphs; ``None`` where a bucket is one all-reduce."""
    if kind.program is None:
        return None
    if runtime.hook is None:
        hook, hook_state = ddp_hooks.comm_hook(ddp)
        runtime.hook = kind.program(hook, hook_state, spec)
    return runtime.hook


# -- the plan all ranks agree on ------------------------------------------------------------


def fused_plan(job: GraphJob, spec: CommSpec, caps: BucketCaps, state: FusedState, *, rows: bool = True) -> FusedPlan:
    """Buckets to all-reduce and tables to gather as rows, agreed on by all ranks."""
    params = job.params
    # The parameters a shared block reduces itself are its own bucket (NOTE [a bucket per block]).
    inside = block_buckets(job.gm, params)
    in_blocks = frozenset(p.reducer_index for b in inside for p in b)
    params = [p for p in params if p.reducer_index not in in_blocks]
    renormed = renormed_tables(job.gm, params)
    if renormed:
        log.info(
            "bucketwise fused: %s reduced after the backward: max_norm renormalises it in place",
            ", ".join(p.name for p in renormed),
        )
        params = [p for p in params if p not in renormed]
    dense = plan_buckets(ready_order(params), caps)
    # Tables reduced as gathered rows (NOTE [embedding rows]) leave the buckets.
    tables = plan_embedding_rows(job.gm, params, spec.world_size) if rows else []
    gathered = {t.param.reducer_index for t in tables}
    buckets = (
        plan_buckets(ready_order([p for p in params if p.reducer_index not in gathered]), caps) if tables else dense
    )
    if inside:
        dense, buckets = _in_ready_order(dense + inside), _in_ready_order(buckets + inside)
    # NOTE [fused layout check]: a fused graph's collectives line up with other ranks' only if
    # they run the same bucket layout. Each new layout is compared once, on a gloo side group; a
    # rank compiling alone (a recompile on one rank) times out and raises RankMismatchError
    # instead of hanging in a mismatched allreduce. Ranks looking up different numbers of ids
    # fall back to all-reducing the tables.
    layout = tuple(_layout_signature(buckets, spec) + [t.signature(spec) for t in tables])
    if layout in state.checked_layouts:
        return FusedPlan(buckets, tables, in_blocks=in_blocks)
    dense_layout = tuple(_layout_signature(dense, spec))
    context = _compile_context(recompile_reason=dc.recompile_reason(), graph_id=job.graph_id)
    if tables:
        context += (
            f"; this graph gathers embedding gradients as rows ({tables[0].signature(spec)}), which "
            "needs every rank to look up as many ids: pass gather_embedding_rows=False otherwise"
        )
    pg = ddpc.process_group(job.ddp)
    check_start = time.perf_counter()
    everyone = gather_on_all_ranks((layout, dense_layout), pg, what="fused bucket layout", context=context)
    if all(theirs[0] == layout for theirs in everyone):
        state.checked_layouts.add(layout)
        return FusedPlan(buckets, tables, time.perf_counter() - check_start, in_blocks)
    if any(theirs[0] != theirs[1] for theirs in everyone):
        log.warning(
            "bucketwise fused: ranks look up different numbers of ids in graph %d; its embedding "
            "tables are all-reduced whole",
            job.graph_id,
        )
    check_same_on_all_ranks(
        dense_layout, pg, what="fused bucket layout", gathered=[t[1] for t in everyone], fix=layout_fix(job.ddp)
    )
    state.checked_layouts.add(dense_layout)
    return FusedPlan(dense, [], time.perf_counter() - check_start, in_blocks)


def layout_fix(ddp: Any) -> str:
    """The fix to suggest when ranks' fused layouts differ (usually: they read different params)."""
    if ddpc.find_unused_parameters(ddp):
        return (
            "strategy='fused' needs every rank's graph to read the same parameters; where ranks use different "
            "parameters, pass strategy='split' or 'auto': DDP's reducer then reduces, and handles them"
        )
    return (
        "where ranks use different parameters (a branch on the rank, a layer some ranks skip), DDP needs "
        "find_unused_parameters=True, as in eager DDP: wrap the model as DDP(model, find_unused_parameters=True) "
        "and keep strategy='auto', which then lets DDP's reducer reduce (split)"
    )


def block_buckets(gm: Any, params: Sequence[GraphParam]) -> list[list[GraphParam]]:
    """The buckets shared blocks reduce themselves, one per block (NOTE [a bucket per block])."""
    by_node = {p.node: p for p in params}
    out = []
    for node in gm.graph.nodes:
        reduced = node.meta.get(REDUCED_PARAMS_META)
        if reduced:
            out.append([by_node[n] for n in reduced])
    return out


def _in_ready_order(buckets: list[list[GraphParam]]) -> list[list[GraphParam]]:
    """Buckets sorted as their gradients get ready (bucket 0 first), by their first parameter."""
    rank = {p.reducer_index: i for i, p in enumerate(ready_order([p for b in buckets for p in b]))}
    return sorted(buckets, key=lambda b: min(rank[p.reducer_index] for p in b))


def _compile_context(*, recompile_reason: str | None, graph_id: int) -> str:
    if recompile_reason:
        return f"this rank is recompiling (guard failed: {recompile_reason[:200]})"
    return f"this rank is compiling its graph number {graph_id}"


def _layout_signature(buckets: Sequence[Sequence[GraphParam]], spec: CommSpec) -> list[str]:
    return [
        f"bucket {i}: {len(b)} params, {sum(p.tensor.numel() for p in b)} elements, "
        f"{b[0].dtype}, {spec.describe()}, [{b[0].name} .. {b[-1].name}]"
        for i, b in enumerate(buckets)
    ]


def _wire_bytes(bucket: Sequence[GraphParam], spec: CommSpec) -> int:
    if spec.comm_dtype is None:
        return sum(p.nbytes for p in bucket)
    return sum(p.tensor.numel() for p in bucket) * spec.comm_dtype.itemsize
