"""DDP training-step benchmark: eager DDP vs ``torch.compile`` vs ``bucketwise.compile``.

    python -m bucketwise.benchmarks ddp --nproc 2 --model gpt --configs eager,torch,local,bw-split \
        --steps 30 --warmup 5 --out DIR

Started without torchrun (no ``RANK`` in the environment) it re-executes itself through
``python -m torch.distributed.run --standalone --nproc-per-node N``. Every rank then runs the
configs in turn (fresh model, same seed, Dynamo reset between configs); rank 0
writes ``results.jsonl``, ``results.md`` and the plots. With ``--rounds N`` every config runs N
times, interleaved: built and compiled once, kept alive beside the others (no Dynamo reset, each
model with code of its own: NOTE [configs side by side]) and timed again in each later round.
See benchmarks/README.md.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

from bucketwise.benchmarks.core import metrics as bm
from bucketwise.benchmarks.core.configs import Prepared, Recipe, recipe_for
from bucketwise.benchmarks.core.isolation import own_code, side_by_side_compile_limits
from bucketwise.benchmarks.core.meta import run_meta
from bucketwise.benchmarks.core.models import ModelSpec, make_spec
from bucketwise.benchmarks.core.output import add_floor_ratios, safe_name, write_jsonl, write_markdown
from bucketwise.benchmarks.core.procs import ALWAYS_ENV
from bucketwise.benchmarks.core.step import LR, make_step
from bucketwise.benchmarks.ddp import restart as br
from bucketwise.benchmarks.ddp.cli import (
    ARGV_ENV,
    COMMAND_ENV,
    NO_CACHE_ENV,
    RECORD_ENV,
    SOCKET_ENV,
    BenchArgs,
    cache_env_errors,
    job_env,
    parse,
    rank_argv,
    relaunch,
)
from bucketwise.distributed.gloo_exit import end_process_group


def _fresh_state(device: torch.device, *, reset: bool = True) -> None:
    """Memory freed and its peak reset; ``reset``: Dynamo's compiled frames dropped too
    (``torch.compiler.reset()``; not with ``--rounds``, whose configs stay compiled)."""
    if reset:
        torch.compiler.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _profile(args: BenchArgs, config: str, step: Callable[[], Any], device: torch.device, rank: int) -> dict:
    """Overlap figures of ``args.profile_steps`` traced steps; rank 0 also saves the timeline
    of the last traced backward pass to ``OUT/timeline/<config>.json``."""
    trace_dir = os.path.join(args.out, "traces")
    os.makedirs(trace_dir, exist_ok=True)
    path = os.path.join(trace_dir, f"{safe_name(config)}-rank{rank}.json")
    events = bm.profile_trace(step, args.profile_steps, device, path)
    overlap = bm.overlap_from_events(events, args.profile_steps)
    if rank == 0:
        os.makedirs(os.path.join(args.out, "timeline"), exist_ok=True)
        timeline = {"config": config, "rank": rank, **bm.backward_timeline(events)}
        with open(os.path.join(args.out, "timeline", safe_name(config) + ".json"), "w") as f:
            json.dump(timeline, f)
    if not args.keep_traces:
        os.remove(path)
    return overlap


def _train_and_time(
    args: BenchArgs, step: Callable[[], torch.Tensor], device: torch.device, *, first: bool = True
) -> dict[str, Any]:
    """The first step (``first``; a later round of ``--rounds`` has none), the warm-up steps and
    the timed steps; the loss of every one of them is read after the timed loop, in one host sync."""
    first_s, first_loss = bm.time_first_step(step, device) if first else (None, None)
    warm = [step() for _ in range(args.warmup)]
    timed = bm.time_steps(step, args.steps, device)
    issue, cpu = timed.cpu_issue_ms, timed.cpu_time_ms
    out = {
        **bm.summarize(timed.per_step_ms),
        "mean_ms": timed.mean_ms,
        "first_step_s": first_s,
        "notes": [],
        "per_step_ms": timed.per_step_ms,
        "cpu_issue_ms": {"median": statistics.median(issue), "max": max(issue)},
        "cpu_time_ms": {"median": statistics.median(cpu), "max": max(cpu)},
        "losses": bm.read_scalars([*([first_loss] if first else []), *warm, *timed.outputs]),
    }
    if not first:
        del out["first_step_s"]
    return out


def _setup(
    args: BenchArgs,
    config: str,
    recipe: Recipe,
    spec: ModelSpec,
    device: torch.device,
    rank: int,
    *,
    side_by_side: bool = False,
):
    """A fresh model, compiled by ``recipe`` over ``config``'s compile caches, its optimizer and
    batch. ``side_by_side`` (``--rounds``): the configs built earlier stay compiled (no Dynamo
    reset) and the model gets code of its own (NOTE [configs side by side])."""
    _fresh_state(device, reset=not side_by_side)
    br.use_config_cache(args.cache_dir, config, cold=args.phase == "cold")
    torch.manual_seed(args.seed)
    model = spec.build().to(device)
    if side_by_side:
        own_code(model)
    prepared = recipe.prepare(model, device=device, backend=args.backend, bucket_cap_mb=args.bucket_cap_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True if device.type == "cuda" else None)
    batch = spec.make_batch(args.seed + 1 + rank, device)
    return model, prepared, opt, batch


def measure(args: BenchArgs, config: str, recipe: Recipe, spec: ModelSpec, device: torch.device, rank: int) -> dict:
    """This rank's measurements of one config (raises on failure)."""
    model, prepared, opt, batch = _setup(args, config, recipe, spec, device, rank)
    kw = dict(mark_cudagraph_step=recipe.mode == "reduce-overhead")
    step = make_step(prepared, spec, opt, batch, device, annotate=False, **kw)

    out = _train_and_time(args, step, device)
    out["param_spread"] = bm.param_spread(model.parameters()) if recipe.ddp else None
    out["peak_mib"] = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    _report(out, prepared)
    _report_file_and_profiles(args, config, recipe, prepared, spec, opt, batch, step, device, rank, out)
    return out


def _report(out: dict, prepared: Prepared) -> None:
    """The bucketwise report's totals and compile seconds (``None`` for the other compilers)."""
    out["bucketwise"] = dict(prepared.report.totals) if prepared.report is not None else None
    out["compile_s"] = out["bucketwise"]["compile_seconds"] if out["bucketwise"] else None


def _report_file_and_profiles(
    args: BenchArgs,
    config: str,
    recipe: Recipe,
    prepared: Prepared,
    spec: ModelSpec,
    opt: torch.optim.Optimizer,
    batch: tuple,
    step: Callable[[], torch.Tensor],
    device: torch.device,
    rank: int,
    out: dict,
) -> None:
    """After the timed steps: rank 0's bucketwise report to ``OUT/reports``, the profiled steps
    (``overlap``, CUDA) and the host profile (``--host-profile``)."""
    if prepared.report is not None and rank == 0:
        os.makedirs(os.path.join(args.out, "reports"), exist_ok=True)
        prepared.report.to_json(os.path.join(args.out, "reports", safe_name(config) + ".json"))
    out["overlap"] = None
    if device.type == "cuda" and args.profile_steps > 0:
        kw = dict(mark_cudagraph_step=recipe.mode == "reduce-overhead")
        annotated = make_step(prepared, spec, opt, batch, device, annotate=True, **kw)
        try:
            out["overlap"] = _profile(args, config, annotated, device, rank)
        except Exception as exc:  # noqa: BLE001 - timings stand without the trace
            out["notes"].append(f"profiler failed: {type(exc).__name__}: {exc}")
    if args.host_profile > 0:
        os.makedirs(os.path.join(args.out, "host_profile"), exist_ok=True)
        path = os.path.join(args.out, "host_profile", safe_name(config) + ".txt")
        bm.host_profile(step, args.host_profile, device, path, enabled=rank == 0)


def measure_restart(
    args: BenchArgs, config: str, recipe: Recipe, spec: ModelSpec, device: torch.device, rank: int
) -> dict:
    """The restarted job (``--phase warm``): one config's first step and warm-up steps over the
    compile caches the first job filled (raises on failure)."""
    _, prepared, opt, batch = _setup(args, config, recipe, spec, device, rank)
    step = make_step(
        prepared, spec, opt, batch, device, annotate=False, mark_cudagraph_step=recipe.mode == "reduce-overhead"
    )
    first_s, _ = bm.time_first_step(step, device)
    for _ in range(args.warmup):
        step()
    bm.sync(device)
    times = prepared.report.totals.get("compile_times") if prepared.report is not None else None
    return {"first_step_s": first_s, "compile_times": times}


def _notes(first: dict) -> list[str]:
    notes = list(first["notes"])
    bw = first.get("bucketwise")
    if bw:
        notes += [
            f"{bw[k]} {label}"
            for k, label in (
                ("fallbacks", "segment(s) fell back to eager"),
                ("graph_breaks", "graph break(s)"),
                ("recompiles", "recompile(s)"),
            )
            if bw.get(k)
        ]
        notes.append(f"{bw['graphs']} graph(s), {bw['segments']} segment(s)")
    return notes


def loss_summary(per_rank: list[list[float]], keep: int = 5) -> dict[str, Any]:
    """The training loss per step, averaged over ranks (the loss of the global batch: every rank
    has a batch of the same size): its first and last ``keep`` values, ``final_loss`` (the loss of
    the last timed step, computed after ``steps_total - 1`` optimizer steps) and each rank's own
    final loss."""
    mean = [sum(v) / len(v) for v in zip(*per_rank)]
    return {
        "steps_total": len(mean),
        "first": mean[:keep],
        "last": mean[-keep:],
        "final_loss": mean[-1],
        "per_rank_final": [r[-1] for r in per_rank],
    }


def _error_row(row: dict[str, Any], errors: list[tuple[int, str]]) -> dict[str, Any]:
    """An ``error`` row: the last line of each distinct traceback with the ranks that raised it."""
    by_message: dict[str, list[str]] = {}
    for r, tb in errors:
        by_message.setdefault(tb.strip().splitlines()[-1], []).append(str(r))
    summary = "; ".join(f"rank{'s' * (len(rs) > 1)} {','.join(rs)}: {m}" for m, rs in by_message.items())
    return {**row, "status": "error", "error": summary, "traceback": errors[0][1]}


def _per_rank(ranks: list[dict], slow: int) -> dict[str, Any]:
    """Every rank's own figures (``per_step_ms``: each timed step, ms, rounded to 0.001)."""
    return {
        "slowest_rank": slow,
        "median_ms": [d["median_ms"] for d in ranks],
        "first_step_s": [d["first_step_s"] for d in ranks],
        **{
            k: [d["overlap"][k] if d["overlap"] else None for d in ranks]
            for k in ("nccl_ms_per_step", "exposed_ms_per_step")
        },
        "cpu_issue_ms": [{k: round(v, 3) for k, v in d["cpu_issue_ms"].items()} for d in ranks],
        "cpu_time_ms": [{k: round(v, 3) for k, v in d["cpu_time_ms"].items()} for d in ranks],
        "per_step_ms": [[round(t, 3) for t in d["per_step_ms"]] for d in ranks],
    }


def merge_ranks(config: str, recipe: Recipe, ranks: list[dict], spec: ModelSpec) -> dict:
    """One result row from every rank's measurements: step times of the slowest rank (largest
    median) and their ``spread``, the maximum over ranks of the other figures, overlap of the
    rank the others waited for in the profiled steps, the loss averaged over ranks; per-rank
    lists under ``per_rank``."""
    row: dict[str, Any] = {"type": "result", "config": config, "recipe": dataclasses.asdict(recipe)}
    errors = [(r, d["error"]) for r, d in enumerate(ranks) if "error" in d]
    if errors:
        return _error_row(row, errors)
    slow = max(range(len(ranks)), key=lambda r: ranks[r]["median_ms"])
    s = ranks[slow]
    world = len(ranks)
    row.update(
        status="ok", timed_steps=s["timed_steps"], **{k: s[k] for k in ("median_ms", "min_ms", "max_ms", "mean_ms")}
    )
    row["first_step_s"] = max(d["first_step_s"] for d in ranks)
    row["warm_first_step_s"] = None  # the restarted job's (--restart)
    row["compile_s"] = max(d["compile_s"] for d in ranks) if s["compile_s"] is not None else None
    row["peak_mib"] = max(d["peak_mib"] for d in ranks) if s["peak_mib"] is not None else None
    row["throughput_per_s"] = spec.items_per_batch * world / (s["median_ms"] / 1e3)
    row["throughput_unit"] = f"{spec.unit}/s (all ranks)"
    # A rank's NCCL kernels also run while they wait for the other ranks to join; the rank with
    # the least NCCL time is the one the others waited for (the slowest rank while profiled).
    overlaps = [(r, d["overlap"]) for r, d in enumerate(ranks) if d["overlap"]]
    laggard = min(overlaps, key=lambda x: x[1]["nccl_ms"]) if overlaps else None
    for key in ("nccl_ms_per_step", "overlapped_ms_per_step", "exposed_ms_per_step"):
        row[key] = laggard[1][key] if laggard else None
    row["overlap"] = {"rank": laggard[0], **laggard[1]} if laggard else None
    row["per_rank"] = _per_rank(ranks, slow)
    row["spread"] = {"rank": slow, **bm.spread(s["per_step_ms"])}
    row["losses"] = loss_summary([d["losses"] for d in ranks])
    row["param_spread"] = s.get("param_spread")
    row["bucketwise"] = ranks[0]["bucketwise"]
    row["notes"] = _notes(ranks[0])
    if row["param_spread"]:
        row["notes"].append(f"replicas diverged: parameters differ across ranks by up to {row['param_spread']:.3g}")
    return row


def _skipped_row(config: str, recipe: Recipe) -> dict:
    return {"type": "result", "config": config, "status": "skipped", "skipped": f"{recipe.needs_cuda}; not run on CPU"}


def run_config(args: BenchArgs, config: str, spec: ModelSpec, device: torch.device, rank: int) -> dict:
    """Measure one config on every rank; every rank returns the same merged row. A failure is
    caught per rank and becomes an ``error`` row; all ranks still meet at the gather."""
    recipe = recipe_for(config)
    if recipe.needs_cuda and device.type != "cuda":
        return _skipped_row(config, recipe)
    try:
        local = measure(args, config, recipe, spec, device, rank)
        local["timed_steps"] = args.steps
    except Exception:  # noqa: BLE001 - one config failing must not stop the others
        local = {"error": traceback.format_exc()}
        print(f"[rank {rank}] {config} failed:\n{local['error']}", file=sys.stderr, flush=True)
    _fresh_state(device)
    return merge_ranks(config, recipe, bm.gather(local), spec)


# --- --rounds N: every config built once, then timed again in each round ---------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Built:
    """A config built and compiled in the first round of ``--rounds``, kept for the others."""

    model: torch.nn.Module
    prepared: Prepared
    opt: torch.optim.Optimizer
    batch: tuple
    step: Callable[[], torch.Tensor]
    rest_bytes: int
    """Device memory it holds between steps: allocated after its first round less what was
    allocated before it was built (0 on CPU)."""


def _allocated(device: torch.device) -> int:
    bm.sync(device)
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def measure_round(
    args: BenchArgs,
    config: str,
    recipe: Recipe,
    spec: ModelSpec,
    device: torch.device,
    rank: int,
    built: dict[str, Built],
    k: int,
) -> dict:
    """This rank's measurements of one config in round ``k`` of ``--rounds`` (raises on failure).
    Round 1 builds the config beside those built before it (kept in ``built``) and times its
    first step as a one-round run does; a later round times ``--warmup`` + ``--steps`` more steps
    of the same objects. Peak memory is the config's own: the peak above what the other configs
    held when its block began. The last round adds what a one-round run measures after the timed
    steps (``param_spread``, the report file, the profiled steps, the host profile)."""
    cuda = device.type == "cuda"
    if k == 1:
        _fresh_state(device, reset=False)
        others = _allocated(device)
        model, prepared, opt, batch = _setup(args, config, recipe, spec, device, rank, side_by_side=True)
        kw = dict(mark_cudagraph_step=recipe.mode == "reduce-overhead")
        step = make_step(prepared, spec, opt, batch, device, annotate=False, **kw)
        out = _train_and_time(args, step, device)
        b = Built(
            model=model,
            prepared=prepared,
            opt=opt,
            batch=batch,
            step=step,
            rest_bytes=_allocated(device) - others,
        )
        built[config] = b
    else:
        b = built[config]
        others = _allocated(device) - b.rest_bytes
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        out = _train_and_time(args, b.step, device, first=False)
    out["timed_steps"] = args.steps
    out["peak_mib"] = (torch.cuda.max_memory_allocated(device) - others) / 2**20 if cuda else None
    _report(out, b.prepared)
    out["param_spread"], out["overlap"] = None, None
    if k == args.rounds:
        out["param_spread"] = bm.param_spread(b.model.parameters()) if recipe.ddp else None
        _report_file_and_profiles(args, config, recipe, b.prepared, spec, b.opt, b.batch, b.step, device, rank, out)
    return out


def _rank_over_rounds(rounds: list[dict]) -> dict:
    """One rank's measurements of every round as one (what :func:`merge_ranks` merges): the
    median over rounds of its round medians, the lowest and highest step, every timed step and
    loss in training order, CPU issue times (median of round medians, largest maximum), the
    highest peak; the first step from round 1, ``param_spread``, the profile
    and the report's totals from the last round."""
    first, last = rounds[0], rounds[-1]
    return {
        **first,
        **{k: last[k] for k in ("param_spread", "overlap", "bucketwise", "compile_s")},
        "timed_steps": sum(d["timed_steps"] for d in rounds),
        "median_ms": statistics.median(d["median_ms"] for d in rounds),
        "min_ms": min(d["min_ms"] for d in rounds),
        "max_ms": max(d["max_ms"] for d in rounds),
        "mean_ms": statistics.fmean(d["mean_ms"] for d in rounds),
        "per_step_ms": [t for d in rounds for t in d["per_step_ms"]],
        **{
            key: {
                "median": statistics.median(d[key]["median"] for d in rounds),
                "max": max(d[key]["max"] for d in rounds),
            }
            for key in ("cpu_issue_ms", "cpu_time_ms")
        },
        "losses": [x for d in rounds for x in d["losses"]],
        "peak_mib": None if first["peak_mib"] is None else max(d["peak_mib"] for d in rounds),
        "notes": [n for d in rounds for n in d["notes"]],
    }


def _round_figures(k: int, ranks: list[dict]) -> dict[str, Any]:
    """Round ``k``'s own figures: the step times of its slowest rank (largest median), its
    spread, the largest CPU issue median and peak over ranks, every rank's median and timed
    steps and the loss of its last step (mean over ranks)."""
    slow = max(range(len(ranks)), key=lambda r: ranks[r]["median_ms"])
    s = ranks[slow]
    figures: dict[str, Any] = {"round": k, **{key: s[key] for key in ("median_ms", "min_ms", "max_ms", "mean_ms")}}
    if k == 1:
        figures["first_step_s"] = max(d["first_step_s"] for d in ranks)
    figures.update(
        spread={"rank": slow, **bm.spread(s["per_step_ms"])},
        cpu_issue_ms=max(d["cpu_issue_ms"]["median"] for d in ranks),
        cpu_time_ms=max(d["cpu_time_ms"]["median"] for d in ranks),
        peak_mib=None if s["peak_mib"] is None else max(d["peak_mib"] for d in ranks),
        final_loss=statistics.fmean(d["losses"][-1] for d in ranks),
        per_rank={
            "median_ms": [d["median_ms"] for d in ranks],
            "per_step_ms": [[round(t, 3) for t in d["per_step_ms"]] for d in ranks],
        },
    )
    return figures


def merge_rounds(config: str, recipe: Recipe, rounds: list[list[dict]], spec: ModelSpec) -> dict:
    """One result row from the rounds of ``--rounds`` done so far: ``rounds[k][r]`` is rank
    ``r``'s measurements in round ``k + 1``. ``median_ms`` is the median over rounds of each
    round's median (the slowest rank's, as :func:`merge_ranks` takes it), ``min_ms``/``max_ms``
    the lowest and highest timed step of those ranks, ``mean_ms`` the mean of the rounds' wall-clock
    means; ``round_spread``: the lowest and highest round median and (max - min) / median in
    percent; ``rounds``: each round's own figures (:func:`_round_figures`). The rest is
    :func:`merge_ranks`'s over every round (:func:`_rank_over_rounds`): ``losses`` cover every
    step in training order, ``per_rank`` every round's steps, ``spread`` the steps of the rank
    with the largest median of round medians. An error in any round makes the row an ``error``
    row naming the round."""
    for k, ranks in enumerate(rounds, 1):
        if any("error" in d for d in ranks):
            return {**merge_ranks(config, recipe, ranks, spec), "round": k}
    per_round = [_round_figures(k, ranks) for k, ranks in enumerate(rounds, 1)]
    row = merge_ranks(config, recipe, [_rank_over_rounds(list(r)) for r in zip(*rounds)], spec)
    medians = [f["median_ms"] for f in per_round]
    median = statistics.median(medians)
    row.update(
        median_ms=median,
        min_ms=min(f["min_ms"] for f in per_round),
        max_ms=max(f["max_ms"] for f in per_round),
        mean_ms=statistics.fmean(f["mean_ms"] for f in per_round),
        throughput_per_s=spec.items_per_batch * len(rounds[0]) / (median / 1e3),
    )
    row["round_spread"] = {
        "min_ms": min(medians),
        "max_ms": max(medians),
        "pct": 100 * (max(medians) - min(medians)) / median,
    }
    row["rounds"] = per_round
    return row


def _round_progress(k: int, rounds: int, i: int, n: int, row: dict) -> str:
    if row["status"] != "ok" or k == 1:
        return f"[round {k}/{rounds}] " + _progress(i, n, row)
    r = row["rounds"][-1]
    return (
        f"[round {k}/{rounds}] [{i}/{n}] {row['config']}: median {r['median_ms']:.2f} ms "
        f"(min {r['min_ms']:.2f}, max {r['max_ms']:.2f}); over rounds {row['median_ms']:.2f} ms, "
        f"spread {row['round_spread']['pct']:.1f}%, loss {row['losses']['final_loss']:.4f} "
        f"after {row['losses']['steps_total']} steps"
    )


def run_rounds(args: BenchArgs, spec: ModelSpec, device: torch.device, rank: int, meta: dict) -> list[dict]:
    """``--rounds N``: every config in turn, N times (A B C, A B C, ...), each built and
    compiled once in round 1 and kept alive beside the others; rounds 2..N start with the
    allreduce probe (``meta["allreduce_probe_rounds"]``). Rank 0 rewrites the records after
    every config of every round. A config that fails on any rank in any round becomes an
    ``error`` row and is dropped from the later rounds."""
    built: dict[str, Built] = {}
    measured: dict[str, list[list[dict]]] = {}
    ended: dict[str, dict] = {}
    n = len(args.configs)
    rows: list[dict] = []
    for k in range(1, args.rounds + 1):
        if k > 1:
            meta["allreduce_probe_rounds"].append(
                bm.allreduce_probe(spec.describe()["params"], device, args.probe_iters)
            )
        for i, config in enumerate(args.configs, 1):
            if config in ended:
                continue
            recipe = recipe_for(config)
            if recipe.needs_cuda and device.type != "cuda":
                ended[config] = _skipped_row(config, recipe)
            else:
                if rank == 0:
                    print(f"[round {k}/{args.rounds}] [{i}/{n}] {config} ...", flush=True)
                try:
                    local = measure_round(args, config, recipe, spec, device, rank, built, k)
                except Exception:  # noqa: BLE001 - one config failing must not stop the others
                    local = {"error": traceback.format_exc()}
                    print(f"[rank {rank}] {config} failed in round {k}:\n{local['error']}", file=sys.stderr, flush=True)
                measured.setdefault(config, []).append(bm.gather(local))
                if any("error" in d for d in measured[config][-1]):
                    built.pop(config, None)
                    _fresh_state(device, reset=False)
                    ended[config] = merge_rounds(config, recipe, measured[config], spec)
            rows = [
                ended.get(c) or merge_rounds(c, recipe_for(c), measured[c], spec)
                for c in args.configs
                if c in ended or c in measured
            ]
            if rank == 0:
                add_floor_ratios(rows)
                write_jsonl(os.path.join(args.out, "results.jsonl"), meta, rows)
                write_markdown(os.path.join(args.out, "results.md"), meta, rows)
                row = next(r for r in rows if r["config"] == config)
                print(_round_progress(k, args.rounds, i, n, row), flush=True)
            dist.barrier()
    built.clear()
    _fresh_state(device, reset=False)
    return rows


def build_meta(args: BenchArgs, spec: ModelSpec, device: torch.device, probe: dict) -> dict:
    # The command the user typed: the parent's, handed to the torchrun ranks it started.
    command = os.environ.get(COMMAND_ENV) or shlex.join(getattr(sys, "orig_argv", sys.argv)) + "  # under torchrun"
    cuda = device.type == "cuda"
    return {
        **run_meta(),
        "type": "meta",
        "command": command,
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if cuda else (platform.processor() or "cpu"),
        "gpu": torch.cuda.get_device_name(device) if cuda else None,
        "world_size": dist.get_world_size(),
        "dist_backend": dist.get_backend(),
        "net": args.net,
        "env": {k: os.environ.get(k) for k in (*ALWAYS_ENV, *SOCKET_ENV, *NO_CACHE_ENV, *RECORD_ENV)},
        "compile_cache": args.compile_cache,
        "restart": False,
        "compile_backend": args.backend,
        "bucket_cap_mb": args.bucket_cap_mb,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "steps": args.steps,
        "warmup": args.warmup,
        **({"rounds": args.rounds} if args.rounds > 1 else {}),
        "profile_steps": args.profile_steps if cuda else 0,
        "seed": args.seed,
        "configs": list(args.configs),
        "model": spec.describe(),
        "allreduce_probe": probe,
    }


def _progress(i: int, n: int, row: dict) -> str:
    head = f"[{i}/{n}] {row['config']}"
    if row["status"] != "ok":
        return f"{head}: {row['status']}: {row.get('error') or row.get('skipped')}"
    text = (
        f"{head}: median {row['median_ms']:.2f} ms (min {row['min_ms']:.2f}, max {row['max_ms']:.2f}), "
        f"first step {row['first_step_s']:.1f} s"
    )
    if row.get("compile_s") is not None:
        text += f", compile {row['compile_s']:.1f} s"
    if row.get("exposed_ms_per_step") is not None:
        text += f", exposed comm {row['exposed_ms_per_step']:.2f} ms/step"
    return text + f", loss {row['losses']['final_loss']:.4f} after {row['losses']['steps_total']} steps"


def run_all(args: BenchArgs, device: torch.device) -> None:
    rank = dist.get_rank()
    spec = make_spec(args.model, args.sizes)
    probe = bm.allreduce_probe(spec.describe()["params"], device, args.probe_iters)
    meta = build_meta(args, spec, device, probe)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        write_jsonl(os.path.join(args.out, "results.jsonl"), meta, [])
        print(
            f"{meta['model']['model']}: {meta['model']['params']:,} params, {meta['world_size']} x "
            f"{meta['device_name']}; allreduce probe {probe['median_ms']:.2f} ms; results -> {args.out}",
            flush=True,
        )
    rows: list[dict] = []
    if args.rounds > 1:
        meta["allreduce_probe_rounds"] = [probe]
        # Each config keeps Dynamo's per-frame budget it has alone (NOTE [configs side by side]).
        with side_by_side_compile_limits(len(args.configs)):
            rows = run_rounds(args, spec, device, rank, meta)
    for i, config in enumerate(args.configs if args.rounds == 1 else [], 1):
        if rank == 0:
            print(f"[{i}/{len(args.configs)}] {config} ...", flush=True)
        rows.append(run_config(args, config, spec, device, rank))
        if rank == 0:
            add_floor_ratios(rows)
            write_jsonl(os.path.join(args.out, "results.jsonl"), meta, rows)
            write_markdown(os.path.join(args.out, "results.md"), meta, rows)
            print(_progress(i, len(args.configs), rows[-1]), flush=True)
        dist.barrier()
    if rank == 0:
        from bucketwise.benchmarks.tables.plots import make_plots

        make_plots(args.out, meta, rows, args.timeline_config)
        print(f"wrote {os.path.join(args.out, 'results.md')}", flush=True)


def run_restart(args: BenchArgs, device: torch.device) -> None:
    """``--phase warm``: every config's first step again, over the first job's compile caches;
    rank 0 adds the figures to the first job's records (``bench_restart.merge_warm``)."""
    rank = dist.get_rank()
    spec = make_spec(args.model, args.sizes)
    warm: dict[str, dict] = {}
    for i, config in enumerate(args.configs, 1):
        recipe = recipe_for(config)
        if recipe.needs_cuda and device.type != "cuda":
            continue
        try:
            local = measure_restart(args, config, recipe, spec, device, rank)
        except Exception:  # noqa: BLE001 - one config failing must not stop the others
            local = {"error": traceback.format_exc()}
            print(f"[rank {rank}] restart of {config} failed:\n{local['error']}", file=sys.stderr, flush=True)
        _fresh_state(device)
        warm[config] = br.merge_warm_ranks(bm.gather(local))
        if rank == 0:
            w = warm[config]
            print(
                f"[{i}/{len(args.configs)}] {config} restarted: "
                + (f"error: {w['error']}" if "error" in w else f"first step {w['first_step_s']:.1f} s"),
                flush=True,
            )
    if rank == 0:
        br.merge_warm(args.out, warm)
        print(f"wrote {os.path.join(args.out, 'results.md')} (with the restart)", flush=True)


def _prime_compiler(backend: str, device: torch.device) -> None:
    """Pay the process's one-time compiler start-up (imports, compile workers, first Triton
    build) before the first config, so its first-step time is comparable with the others'."""
    x = torch.ones(8, 8, device=device, requires_grad=True)
    torch.compile(lambda t: torch.relu(t @ t) * 2, backend=backend)(x).sum().backward()
    bm.sync(device)
    torch.compiler.reset()


def worker(args: BenchArgs) -> int:
    if args.restart and args.phase == "cold" and ARGV_ENV not in os.environ:
        raise SystemExit(
            "ddp: error: --restart runs the job twice: start `python -m bucketwise.benchmarks ddp` itself, "
            "not under torchrun"
        )
    if (error := cache_env_errors(args, os.environ)) is not None:
        raise SystemExit(f"ddp: error: {error}")
    os.environ.update(job_env(args))  # NCCL reads these at communicator creation
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("high")
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo",
        timeout=datetime.timedelta(minutes=args.timeout_min),
        device_id=device if device.type == "cuda" else None,
    )
    own_cache = args.compile_cache == "on" and args.cache_dir is None
    if own_cache:  # started under torchrun directly: one fresh root per job, removed at the end
        args = dataclasses.replace(
            args,
            cache_dir=os.path.join(
                tempfile.gettempdir(), "bucketwise-bench-cache-" + os.environ.get("TORCHELASTIC_RUN_ID", "none")
            ),
        )
    try:
        br.use_config_cache(args.cache_dir, "_prime", cold=args.phase == "cold")
        _prime_compiler(args.backend, device)
        (run_restart if args.phase == "warm" else run_all)(args, device)
        dist.barrier()
    finally:
        end_process_group()
        if own_cache and int(os.environ.get("RANK", "0")) == 0:
            shutil.rmtree(args.cache_dir, ignore_errors=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "RANK" not in os.environ:
        relaunch(parse(argv), argv)  # does not return
    return worker(parse(rank_argv(argv)))


if __name__ == "__main__":
    sys.exit(main())
