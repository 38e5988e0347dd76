"""The fused strategy applied to one Dynamo graph: plan, rank check, graph passes, compile.

For each graph: the comm spec (DDP's reducer or its comm hook), the buckets and the embedding
tables gathered as rows (agreed on by every rank, NOTE [fused layout check]), the graph passes
(``embedding_rows``, ``sync``), the compile (through the compiler's callback) and the runtime's
record of which parameters the graph reduces. A graph whose buckets a comm hook with per-step
host decisions reduces (PowerSGD, a traceable user hook) is compiled per variant instead
(``comm_hooks.HookedGraph``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, ContextManager, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx

from ..._compat import collectives as cc
from ..._compat import ddp as ddpc
from ..._compat import dynamo as dc
from ...partitioners.param_usage import GraphParam, ready_order
from ...partitioners.split import Segment
from ..plan import BucketCaps, plan_buckets
from ..rank_check import check_same_on_all_ranks, gather_on_all_ranks
from ..result import CompileOutcome, CompilePiece, StrategyResult, bucket_stats, op_count
from .cache_keys import comm_pass_key, traced_call_targets
from .comm_hooks import HookedGraph, HookProgram, TracedHookProgram, comm_hook_kind
from .embedding_rows import RowsSync, insert_embedding_rows, plan_embedding_rows, renormed_tables
from .powersgd_run import PowerSGDRun
from .runtime import FusedRuntime
from .sync import CommSpec, backward_positions, insert_bucket_syncs
from .variants import VariantCompiler

log = logging.getLogger(__name__)

CompileVariant = Callable[[fx.GraphModule, list[Any], str], tuple[Callable[..., Any], CompileOutcome]]


@dataclasses.dataclass
class FusedState:
    """What one graph backend keeps across the graphs it compiles with ``fused``."""

    runtime: FusedRuntime
    checked_layouts: set[tuple[str, ...]] = dataclasses.field(default_factory=set)
    """Bucket layouts all ranks agreed on (NOTE [fused layout check])."""
    rank_check_s: float = 0.0
    """Seconds of the cross-rank layout checks of the graph being compiled."""


def fused_backend_options(user_options: dict[str, Any] | None) -> dict[str, Any]:
    """Inductor options of fused compiles, scoped to them: comm/compute reordering with the
    late-waits pass (NOTE [late waits]) and the cache keys of what the passes insert (NOTE
    [compile cache keys]); the user's own options win."""
    options = {**cc.comm_overlap_options(comm_pass_key()), **(user_options or {})}
    return dc.cacheable_calls_options(traced_call_targets(), options)


def apply_fused(
    *,
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    ddp: Any,
    params: Sequence[GraphParam],
    caps: BucketCaps,
    gather_rows: bool,
    state: FusedState,
    graph_id: int,
    compile_graph: CompilePiece,
    compile_variant: CompileVariant,
    progress_step: Callable[[str], ContextManager[None]],
    on_later_variant: Callable[[], None],
) -> StrategyResult:
    """``gm`` with its buckets' collectives traced into its backward, compiled whole."""
    spec = comm_spec(ddp)
    program = _hook_program(ddp, spec, state.runtime)
    if program is not None:
        return _apply_hooked(
            gm=gm,
            example_inputs=example_inputs,
            ddp=ddp,
            params=params,
            caps=caps,
            state=state,
            graph_id=graph_id,
            program=program,
            compile_variant=compile_variant,
            progress_step=progress_step,
            on_later_variant=on_later_variant,
        )
    buckets, tables = fused_plan(gm, ddp, params, spec, caps, state, graph_id=graph_id, rows=gather_rows)
    # What each collective reduces, for the report: buckets, then the gathered tables (a
    # table's gather is issued after the gradient of its first use, its first lookup).
    reduced = [(b, "all_reduce", _wire_bytes(b, spec), None) for b in buckets] + [
        ([t.param], "all_gather rows", t.wire_bytes(spec.comm_dtype), None) for t in tables
    ]
    positions = backward_positions(gm, [group for group, *_ in reduced])
    # Rows first: each lookup is replaced in place (node positions unchanged), so the
    # buckets' first-use positions still hold for insert_bucket_syncs.
    insert_embedding_rows(gm, tables, spec)
    insert_bucket_syncs(gm, buckets, spec)
    what = "whole graph + %d bucket allreduces" % len(buckets) + (" + %d row gathers" % len(tables) if tables else "")
    compiled, outcome = compile_graph(gm, example_inputs, what=what)
    return _result(gm, params, spec, reduced, positions, compiled, outcome, state)


def _apply_hooked(
    *,
    gm,
    example_inputs,
    ddp,
    params,
    caps,
    state,
    graph_id,
    program: HookProgram,
    compile_variant,
    progress_step,
    on_later_variant,
) -> StrategyResult:
    """A graph whose buckets a comm hook reduces: compiled per variant (HookedGraph), from
    copies of ``gm``, which stays as Dynamo gave it. No embedding rows: the hook gets tables
    like any gradient, as in eager DDP."""
    spec = program.plain_spec()
    buckets, _ = fused_plan(gm, ddp, params, spec, caps, state, graph_id=graph_id, rows=False)
    synced = [[p for p in b if p.first_use >= 0] for b in buckets]
    synced = [b for b in synced if b]
    reduced = [(b, *program.wire(b)) for b in synced]
    positions = backward_positions(gm, synced)
    compiler = VariantCompiler(
        gm, example_inputs, program, synced, compile_variant, on_later_variant, f"graph {graph_id}"
    )
    graph = HookedGraph(program, synced, compiler)
    notes = []
    # Equal results with eager DDP need the reducer's buckets (NOTE [powersgd in the graph]).
    if not ddpc.will_rebuild(ddp):
        notes.append(
            f"{program.name}: DDP keeps its construction-time buckets (find_unused_parameters=True), "
            "the fused graphs reduce the planned ones: the hook sees other buckets than in eager DDP"
        )
    elif program.bucket_count() > len(synced):
        notes.append(
            f"{program.name}: several graphs reduce buckets, each its own: the hook sees other "
            "buckets (and indices) than DDP's reducer would give it in eager DDP"
        )
    with progress_step(f"whole graph + {len(synced)} buckets ({program.describe()})"):
        graph.ensure(program.variant(graph))
    result = _result(gm, params, spec, reduced, positions, graph, compiler.first_outcome(), state)
    result.comm_hook, result.variants, result.notes = program.describe(), compiler.variants, notes
    return result


def _result(gm, params, spec, reduced, positions, compiled, outcome, state: FusedState) -> StrategyResult:
    runtime = state.runtime
    key = runtime.graphs_compiled((id(p.tensor) for group, *_ in reduced for p in group), spec)
    used = [p for p in params if p.first_use >= 0]
    seg_of = {p.name: 0 for p in used}
    stats = [
        bucket_stats(i, group, seg_of, pos, spec.describe(), collective, wire, parts)
        for i, ((group, collective, wire, parts), pos) in enumerate(zip(reduced, positions))
    ]
    segment = Segment(index=0, submodule="", params=used, op_count=op_count(gm))
    return StrategyResult(
        fn=FusedRan(compiled, runtime, key),
        segments=[segment],
        outcomes=[outcome],
        buckets=stats,
        plan_source="predicted",
        rank_check_s=state.rank_check_s,
    )


class FusedRan:
    """A fused graph that tells the runtime it ran (see NOTE [fused strategy runtime])."""

    def __init__(self, fn: Callable[..., Any], runtime: FusedRuntime, key: int) -> None:
        self.fn, self.runtime, self.key = fn, runtime, key

    def __call__(self, *args: Any) -> Any:
        self.runtime.graph_ran(self.key)
        return self.fn(*args)


# -- comm hooks in the graph (comm_hooks.py) -----------------------------------------------


def _hook_program(ddp: Any, spec: CommSpec, runtime: FusedRuntime) -> HookProgram | None:
    """The program of the DDP module's comm hook, shared by its graphs; ``None`` for torch's
    allreduce/fp16/bf16 hooks and no hook (plain ``BucketSync``)."""
    kind, _ = comm_hook_kind(ddp)
    if kind not in ("powersgd", "traceable"):
        return None
    if runtime.hook is None:
        hook, hook_state = ddpc.comm_hook(ddp)
        if kind == "powersgd":
            runtime.hook = PowerSGDRun(hook_state, group_spec(hook_state.process_group), dc.mark_static_address)
        else:
            runtime.hook = TracedHookProgram(hook, hook_state, spec)
    return runtime.hook


def comm_spec(ddp: Any) -> CommSpec:
    """How the buckets are reduced: DDP's reducer, or torch's allreduce/fp16/bf16 hook."""
    kind, _ = comm_hook_kind(ddp)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(kind)
    spec = group_spec(ddpc.process_group(ddp))
    return dataclasses.replace(spec, comm_dtype=dtype, divide_first=kind != "reducer")


def group_spec(pg: Any) -> CommSpec:
    """torch's ``allreduce_hook`` on ``pg`` (the default group when ``None``): divide, then sum."""
    pg = pg if pg is not None else dist.group.WORLD
    return CommSpec(group=cc.group_name(pg), world_size=cc.world_size(pg), divide_first=True)


# -- the plan all ranks agree on ------------------------------------------------------------


def fused_plan(
    gm: fx.GraphModule,
    ddp: Any,
    params: Sequence[GraphParam],
    spec: CommSpec,
    caps: BucketCaps,
    state: FusedState,
    *,
    graph_id: int,
    rows: bool = True,
) -> tuple[list[list[GraphParam]], list[RowsSync]]:
    """Buckets to all-reduce and embedding tables to gather as rows (``rows``), agreed on by
    all ranks."""
    renormed = renormed_tables(gm, params)
    if renormed:
        log.info(
            "bucketwise fused: %s reduced after the backward: max_norm renormalises it in place",
            ", ".join(p.name for p in renormed),
        )
        params = [p for p in params if p not in renormed]
    dense = plan_buckets(ready_order(params), caps)
    # Tables reduced as gathered rows (NOTE [embedding rows]) leave the buckets.
    tables = plan_embedding_rows(gm, params, spec.world_size) if rows else []
    gathered = {t.param.reducer_index for t in tables}
    buckets = (
        plan_buckets(ready_order([p for p in params if p.reducer_index not in gathered]), caps) if tables else dense
    )
    # NOTE [fused layout check]: a fused graph's collectives line up with the other ranks'
    # only if they run graphs with the same bucket layout. A layout already checked across
    # ranks is safe wherever it shows up again (the same frame recompiled for a new shape on
    # one rank, the other side of a data-dependent branch compiled a few steps later), so it
    # is not checked again. A new layout is checked with one collective on a gloo side group:
    # ranks that compile it together compare it; a rank that compiles it alone (a recompile
    # on one rank that changes which parameters the graph reads) times out and raises
    # RankMismatchError naming the failed guard, instead of hanging in a mismatched allreduce.
    # Ranks that compile together but look up different numbers of ids (uneven batches)
    # all fall back to all-reducing the tables.
    layout = tuple(_layout_signature(buckets, spec) + [t.signature(spec) for t in tables])
    if layout in state.checked_layouts:
        return buckets, tables
    dense_layout = tuple(_layout_signature(dense, spec))
    context = _compile_context(recompile_reason=dc.recompile_reason(), graph_id=graph_id)
    if tables:
        context += (
            f"; this graph gathers embedding gradients as rows ({tables[0].signature(spec)}), which "
            "needs every rank to look up as many ids: pass gather_embedding_rows=False otherwise"
        )
    pg = ddpc.process_group(ddp)
    check_start = time.perf_counter()
    everyone = gather_on_all_ranks((layout, dense_layout), pg, what="fused bucket layout", context=context)
    state.rank_check_s += time.perf_counter() - check_start
    if all(theirs[0] == layout for theirs in everyone):
        state.checked_layouts.add(layout)
        return buckets, tables
    if any(theirs[0] != theirs[1] for theirs in everyone):
        log.warning(
            "bucketwise fused: ranks look up different numbers of ids in graph %d; its embedding "
            "tables are all-reduced whole",
            graph_id,
        )
    check_same_on_all_ranks(
        dense_layout, pg, what="fused bucket layout", gathered=[t[1] for t in everyone], fix=_LAYOUT_FIX
    )
    state.checked_layouts.add(dense_layout)
    return dense, []


_LAYOUT_FIX = (
    "strategy='fused' needs every rank's graph to read the same parameters; where ranks use different "
    "parameters (find_unused_parameters=True, rank-dependent control flow) use strategy='split' or 'auto', "
    "where DDP's reducer reduces"
)


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
