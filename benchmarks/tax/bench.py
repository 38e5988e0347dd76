"""What DDP and bucketwise add to a compiled training step: configs side by side in one process.

    python -m bucketwise.benchmarks tax --model gpt-medium \
        --configs local,local-ro,torch-nosplit,torch,torch-ca,replicate,bw-fused,bw-fused-cg --pairs 4 --out DIR

On one GPU and one rank (NCCL, world size 1) no gradient moves, so everything a config costs
above ``local`` (``local-ro`` for the CUDA-graph configs) is what the wrapper adds: memory, host
time, GPU time, compile time. Run-to-run spread on a virtual host (25% between two jobs) would
hide that, so every config is built once in the same process and the timed blocks are
interleaved: ``A B C ... C B A`` pairs, the direction alternating; a config's ratio to its floor
is the median of the per-pair ratios of CPU issue time.

Per config (``results.json`` and ``results.md`` in ``--out``):

- ``first_step_s``: the first step, compile included. Each config's model has code of its own
  (NOTE [configs side by side]), so Dynamo compiles every config's frames afresh, and every
  compile cache is off (``torch.compiler.config.force_disable_caches``: Inductor compiles each
  graph in a fresh cache folder, Triton's kernels included); a restart's cold and warm first
  steps are measured by ``--restarts``, each in a new process;
  ``compile_s``: bucketwise's own compile-time total, where it applies; ``compile_breakdown``:
  the report's compile-time breakdown (dynamo, bucketwise, AOTAutograd, backend, caches) and
  ``compile_accounted``, its total over the first step's wall time; ``first_step_breakdown``:
  the report's first step (compile, Triton autotuning, other first-call work, NOTE [first step])
  and ``first_step_accounted``, its total over the first step's wall time;
- ``rest_mib``: memory the config holds between steps (parameters, optimizer state, DDP's
  buckets, live CUDA-graph pool memory); ``first_peak_mib``: its peak over the first step and
  the warm-up steps (``torch.cuda.max_memory_allocated`` above what was allocated before the
  config was built: nothing else runs meanwhile; compile, autotuning and capture included);
  ``peak_mib``: its peak over the timed steps, less the other configs' memory at rest (an
  estimate: it is off where another config's memory changes after it was built, as CUDA-graph
  pools may);
- ``issue_ms``/``process_cpu_ms``/``cpu_ms``/``step_ms``: per pair, the median host time to issue a
  step (wall clock), the CPU time the process spent on it (every thread: on a GPU the backward's
  host work runs on autograd's thread, NOTE [a step's CPU time]; what a neighbour on a shared
  host does not add, though waiting on a full launch queue still counts), the part of it on the
  thread that issues the step (forward and optimizer, on a GPU) and the GPU (CUDA-event) time
  per step; ``kernels``, ``gpu_ms``, ``gpu_idle_ms``: kernels launched, GPU kernel time and the time
  the GPU waited between kernels per step (profiler), ``idle_before_ms``: the kernels the most
  of that wait came before; ``host_us_per_launch``: issue time over kernels launched.

Started without torchrun it runs one rank itself; under torchrun every rank runs the same
interleaving and rank 0 writes its own figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from bucketwise.benchmarks.core import metrics as bm
from bucketwise.benchmarks.core.configs import floor_config, recipe_for
from bucketwise.benchmarks.core.isolation import side_by_side_compile_limits
from bucketwise.benchmarks.core.meta import run_meta
from bucketwise.benchmarks.core.models import MODELS, SIZE_FLAGS, make_spec
from bucketwise.benchmarks.core.output import THREAD_ONLY_MARK, THREAD_ONLY_NOTE, cold_graphs_text, step_cpu
from bucketwise.benchmarks.core.step import training_step
from bucketwise.distributed.gloo_exit import end_process_group

DEFAULT_CONFIGS = "local,local-ro,torch-nosplit,torch,torch-ca,replicate,bw-fused,bw-fused-cg"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt-medium", choices=MODELS)
    for flag in SIZE_FLAGS:
        p.add_argument("--" + flag.replace("_", "-"), type=int, default=None, help="(default: the model's own)")
    p.add_argument(
        "--threads", type=int, default=None, help="torch's CPU threads (torch.set_num_threads; default: torch's)"
    )
    p.add_argument("--configs", default=DEFAULT_CONFIGS)
    p.add_argument("--pairs", type=int, default=4, help="interleaved rounds (>= 3)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per config per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--backend", default="inductor")
    p.add_argument(
        "--restarts",
        type=int,
        default=0,
        metavar="N",
        help="then N interleaved rounds of cold and warm first steps, each in a new process "
        "(benchmarks/tax/restarts.py)",
    )
    p.add_argument("--first-step-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", required=True)
    ns = p.parse_args(argv)
    if ns.pairs < 3 and not (ns.pairs == 0 and ns.restarts):
        p.error(
            f"--pairs must be >= 3 for a median of per-pair ratios (0 with --restarts: restarts only), got {ns.pairs}"
        )
    if ns.restarts < 0:
        p.error(f"--restarts must be 0 or more, got {ns.restarts}")
    ns.configs = ns.configs.split(",")
    for config in ns.configs:
        recipe_for(config)  # unknown names fail here, before anything is built
    return ns


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _allocated() -> int:
    sync()
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


def _reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _peak() -> int:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0


def build(
    config: str, spec: Any, device: torch.device, backend: str, warmup: int, bucket_cap_mb: float | None = None
) -> dict[str, Any]:
    """One config's model, compiled, its first step timed and ``warmup`` more steps run
    (``bucket_cap_mb``: DDP's, where the config wraps the model in DDP)."""
    recipe = recipe_for(config)
    gc.collect()
    before = _allocated()
    _reset_peak()
    t_build = time.perf_counter()
    _, prepared, _, step = training_step(recipe, spec, device, backend, isolated=True, bucket_cap_mb=bucket_cap_mb)
    sync()
    t0 = time.perf_counter()
    step()
    sync()
    first_s = time.perf_counter() - t0
    for _ in range(warmup):
        step()
    rest = _allocated() - before
    report = prepared.report
    totals = report.totals if report is not None else {}
    return {
        "config": config,
        "step": step,
        "first_step_s": first_s,
        "prepare_s": t0 - t_build,
        "rest_bytes": rest,
        "first_peak_bytes": _peak() - before,
        "peak_bytes": 0,
        "compile_s": totals.get("compile_seconds"),
        "compile_breakdown": totals.get("compile_times"),
        "first_step_breakdown": totals.get("first_step"),
        "report": report,
        "issue_ms": [],
        "cpu_ms": [],
        "process_cpu_ms": [],
        "step_ms": [],
    }


def timed_block(entry: dict[str, Any], steps: int, others_at_rest: int) -> None:
    """``steps`` steps of one config: median host issue time, GPU time per step, peak memory."""
    step: Callable[[], Any] = entry["step"]
    sync()
    _reset_peak()
    cuda = torch.cuda.is_available()
    start = torch.cuda.Event(enable_timing=True) if cuda else None
    end = torch.cuda.Event(enable_timing=True) if cuda else None
    if cuda:
        start.record()
    wall = time.perf_counter()
    issue, process, thread = [], [], []
    for _ in range(steps):
        t, p, c = time.perf_counter(), bm.process_cpu_s(), time.thread_time()
        step()
        issue.append((time.perf_counter() - t) * 1e3)
        process.append((bm.process_cpu_s() - p) * 1e3)
        thread.append((time.thread_time() - c) * 1e3)
    if cuda:
        end.record()
    sync()
    entry["issue_ms"].append(statistics.median(issue))
    entry["process_cpu_ms"].append(statistics.median(process))
    entry["cpu_ms"].append(statistics.median(thread))
    entry["step_ms"].append(start.elapsed_time(end) / steps if cuda else (time.perf_counter() - wall) * 1e3 / steps)
    entry["peak_bytes"] = max(entry["peak_bytes"], _peak() - others_at_rest)


def kernel_profile(entry: dict[str, Any], steps: int) -> None:
    """Kernels launched, GPU kernel time and GPU idle time between kernels per step, from
    ``torch.profiler`` (``metrics.gpu_idle``)."""
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available() or steps <= 0:
        entry["kernels"] = entry["gpu_ms"] = entry["gpu_idle_ms"] = entry["idle_before_ms"] = None
        return
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            entry["step"]()
        sync()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    entry["kernels"] = len(kernels) / steps
    entry["gpu_ms"] = sum(e.device_time for e in kernels) / 1e3 / steps
    idle = bm.gpu_idle([(e.time_range.start, e.time_range.end, e.name[:80]) for e in kernels])
    # Per step: how long the GPU waited between kernels, and before which kernels the most.
    entry["gpu_idle_ms"] = idle["idle_us"] / 1e3 / steps
    entry["idle_before_ms"] = {k: v / 1e3 / steps for k, v in idle["before"].items()}


def summarize(entries: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for config, e in entries.items():
        floor = floor_config(config)
        row = {
            k: e.get(k)
            for k in (
                "config",
                "first_step_s",
                "compile_s",
                "compile_breakdown",
                "first_step_breakdown",
                "issue_ms",
                "process_cpu_ms",
                "cpu_ms",
                "step_ms",
                "kernels",
                "gpu_ms",
                "gpu_idle_ms",
                "idle_before_ms",
            )
        }
        times, first = e.get("compile_breakdown"), e.get("first_step_breakdown")
        row["compile_accounted"] = times["total_s"] / e["first_step_s"] if times and e["first_step_s"] else None
        # The report's first-step breakdown: compile + Triton autotuning + other first-call work.
        row["first_step_accounted"] = (
            first["compiled_calls_s"] / e["first_step_s"] if first and e["first_step_s"] else None
        )
        row.update(
            floor=floor,
            rest_mib=e["rest_bytes"] / 2**20,
            peak_mib=e["peak_bytes"] / 2**20,
            first_peak_mib=e["first_peak_bytes"] / 2**20,
            issue_ms_median=statistics.median(e["issue_ms"]),
            process_cpu_ms_median=statistics.median(e["process_cpu_ms"]),
            cpu_ms_median=statistics.median(e["cpu_ms"]),
            step_ms_median=statistics.median(e["step_ms"]),
        )
        row["host_us_per_launch"] = (row["issue_ms_median"] * 1e3 / e["kernels"]) if e.get("kernels") else None
        if e.get("report") is not None:  # how each CUDA graph ran: replays, uncaptured calls and why
            row["cudagraphs"] = [
                {k: c[k] for k in ("name", "replays", "uncaptured_runs", "uncaptured_reasons", "reason", "note")}
                for c in e["report"].to_dict().get("cudagraphs", [])
            ]
            # What the default did with the model's blocks, and why (NOTE [sharing by cost]): each
            # graph's shared blocks (with their estimated call) or the reason not.
            report = e["report"].to_dict()
            row["shared_blocks"] = [g.get("shared_blocks") for g in report.get("graphs", [])]
            row["unshared_blocks"] = report.get("unshared_blocks")
        base = entries.get(floor)
        if base is not None:
            row["issue_ratio"] = statistics.median(a / b for a, b in zip(e["issue_ms"], base["issue_ms"]))
            row["process_cpu_ratio"] = statistics.median(
                a / b for a, b in zip(e["process_cpu_ms"], base["process_cpu_ms"])
            )
            row["cpu_ratio"] = statistics.median(a / b for a, b in zip(e["cpu_ms"], base["cpu_ms"]))
            row["step_ratio"] = statistics.median(a / b for a, b in zip(e["step_ms"], base["step_ms"]))
            row["peak_ratio"] = e["first_peak_bytes"] / base["first_peak_bytes"] if base["first_peak_bytes"] else None
            row["gpu_ratio"] = e["gpu_ms"] / base["gpu_ms"] if e.get("gpu_ms") and base.get("gpu_ms") else None
        rows.append(row)
    return rows


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _cpu_cells(row: dict[str, Any]) -> tuple[str, str]:
    """A row's CPU time and its ratio to the floor, the issuing thread's marked (NOTE [a step's
    CPU time])."""
    ms, ratio, thread_only = step_cpu(row)
    return _fmt(ms, ".2f") + (THREAD_ONLY_MARK if thread_only and ms is not None else ""), _fmt(ratio, ".3f")


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]], restarts: dict[str, Any] | None = None) -> str:
    lines = (
        [_steady_markdown(meta, rows)]
        if rows
        else [
            f"# {meta['model']}",
            "",
            f"{meta['gpu'] or meta['device']}, world size {meta['world_size']}, torch {meta['torch']}, {meta['date']}",
            "",
            f"`{meta['command']}`",
            "",
        ]
    )
    if restarts:
        lines.append(_restarts_markdown(restarts))
    return "\n".join(lines)


def _restarts_markdown(restarts: dict[str, Any]) -> str:
    # Runs that timed building the model (and so restarts from compiled artifacts) get 3 more columns.
    restart_cols = any(r.get("warm_restart_s") is not None for r in restarts["summary"].values())
    head = (
        "| config | cold first step s | x `torch` | warm first step s | x non-graphed | first step accounted "
        "| cold FX graphs compiled / cache hits |"
        + (" warm restart s | fresh machine restart s | x warm restart |" if restart_cols else "")
        + "\n| --- | ---: | ---: | ---: | ---: | ---: | ---: |"
        + (" ---: | ---: | ---: |" if restart_cols else "")
    )
    rows = [
        f"| `{c}` | {_fmt(r['cold_s'], '.2f')} | {_fmt(r.get('cold_over_torch'), '.3f')} | {_fmt(r['warm_s'], '.2f')} "
        f"| {_fmt(r.get('warm_over_uncaptured'), '.3f')} | {_fmt(r.get('first_step_accounted'), '.1%')} "
        f"| {cold_graphs_text(r)} |"
        + (
            f" {_fmt(r.get('warm_restart_s'), '.2f')} | {_fmt(r.get('fresh_restart_s'), '.2f')} "
            f"| {_fmt(r.get('fresh_over_warm'), '.3f')} |"
            if restart_cols
            else ""
        )
        for c, r in restarts["summary"].items()
    ]
    return "\n".join(
        [
            f"## First steps in new processes, {restarts['rounds']} interleaved rounds",
            "",
            head,
            *rows,
            "",
            "cold: a new process over empty compile caches; warm: another over the same caches (a restart). "
            "x `torch`: median over rounds of the cold first step over torch's DDPOptimizer's; x non-graphed: "
            "the warm first step of a CUDA-graph config over its twin's without graphs. first step accounted: "
            "the report's first-step breakdown (compile, Triton autotuning, other first-call work) over the "
            "cold first step's wall time. cold FX graphs: the graphs Inductor compiled or loaded in the cold "
            "process, and how many of them it found in its FX graph cache, filled earlier in the same process "
            "(a graph that repeats, e.g. one per identical block, compiles once). "
            + (
                "warm restart: building and compiling the model in the warm process, then its first step; fresh "
                "machine restart: the same in a new process over empty caches that loads the compiled artifacts "
                "the cold process saved (bucketwise configs; NOTE [compile artifacts]), and its median ratio to "
                "the warm restart. "
                if restart_cols
                else ""
            )
            + "Every run is in results.json.",
            "",
        ]
    )


def _steady_markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    first_peak = {r["config"]: r["first_peak_mib"] for r in rows if "error" not in r}
    for r in rows:
        if "error" not in r and first_peak.get(r["floor"]):
            r["peak_ratio"] = r["first_peak_mib"] / first_peak[r["floor"]]
    # Runs that measured a step's CPU time get its 2 columns (older results.json lack it).
    cpu_cols = any(step_cpu(r)[0] is not None for r in rows if "error" not in r)
    thread_only = any(step_cpu(r)[2] for r in rows if "error" not in r)
    head = (
        "| config | floor | peak MiB | x floor | at rest MiB | CPU issue ms | x floor "
        + ("| CPU time ms | x floor " if cpu_cols else "")
        + "| step ms | x floor | GPU ms | x floor | kernels | host us/launch |"
    )
    ncols = 15 if cpu_cols else 13
    lines = [
        f"# {meta['model']}: configs side by side, {meta['pairs']} interleaved rounds",
        "",
        f"{meta['gpu'] or meta['device']}, world size {meta['world_size']}, torch {meta['torch']}, {meta['date']}",
        "",
        f"`{meta['command']}`",
        "",
        head,
        "|" + " --- |" * ncols,
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| `{r['config']}` | failed: {r['error'].splitlines()[0][:200]} |" + " |" * (ncols - 2))
            continue
        lines.append(
            "| "
            + " | ".join(
                [
                    f"`{r['config']}`",
                    f"`{r['floor']}`",
                    _fmt(r["first_peak_mib"], ",.0f"),
                    _fmt(r.get("peak_ratio"), ".2f"),
                    _fmt(r["rest_mib"], ",.0f"),
                    _fmt(r["issue_ms_median"], ".2f"),
                    _fmt(r.get("issue_ratio"), ".3f"),
                    *(_cpu_cells(r) if cpu_cols else ()),
                    _fmt(r["step_ms_median"], ".2f"),
                    _fmt(r.get("step_ratio"), ".3f"),
                    _fmt(r.get("gpu_ms"), ".2f"),
                    _fmt(r.get("gpu_ratio"), ".3f"),
                    _fmt(r.get("kernels"), ".0f"),
                    _fmt(r.get("host_us_per_launch"), ".1f"),
                ]
            )
            + " |"
        )
    idle = [r for r in rows if r.get("gpu_idle_ms") is not None]
    if idle:
        lines += [
            "",
            "GPU idle between kernels, ms per profiled step, the GPU's busy share of that step (kernel time over "
            "kernel time plus idle: what the runtime view's host-bound and GPU-bound verdicts read), and the "
            "kernels the most of the idle time came before:",
            "",
        ]
        for r in idle:
            top = ", ".join(f"`{k}` {v:.2f}" for k, v in list((r.get("idle_before_ms") or {}).items())[:3])
            busy = r["gpu_ms"] / (r["gpu_ms"] + r["gpu_idle_ms"]) if r.get("gpu_ms") else None
            share = f" (busy {busy:.0%})" if busy is not None else ""
            lines.append(f"- `{r['config']}`: {r['gpu_idle_ms']:.2f}{share}; before {top}")
    lines += [
        "",
        "peak MiB: the config's peak over its first step and warm-up steps (compile and CUDA-graph "
        "capture included), above what was allocated before it was built. "
        + (
            "CPU issue: wall-clock time to issue a step; CPU time: the process's CPU time for it, every "
            "thread (on a GPU the backward's host work runs on autograd's own thread). "
            "x floor: CPU issue, CPU time and step, the "
            if cpu_cols
            else "x floor: CPU issue and step, the "
        )
        + "median over rounds of the per-round ratio to the floor; peak and GPU time, the ratio of the "
        "figures. GPU ms: kernel time per step from the profiler. Per-round figures are in results.json.",
        *(["", THREAD_ONLY_NOTE] if thread_only else []),
    ]
    return "\n".join(lines) + "\n"


def _meta(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    return {
        **run_meta(),
        "model": args.model,
        "sizes": make_spec(args.model, _sizes(args)).sizes,
        "configs": args.configs,
        "pairs": args.pairs,
        "steps": args.steps,
        "warmup": args.warmup,
        "backend": args.backend,
        "device": device.type,
        "world_size": dist.get_world_size(),
    }


def first_step_only(args: argparse.Namespace, device: torch.device) -> None:
    """A child of ``--restarts``: one config's first step and the step after it, over the
    compile caches its environment names (tax_restarts.py)."""
    from bucketwise.benchmarks.tax import restarts as tax_restarts

    started = tax_restarts.started_s()
    entry = build(args.configs[0], make_spec(args.model, _sizes(args)), device, args.backend, warmup=0)
    sync()
    t0 = time.perf_counter()
    entry["step"]()
    sync()
    tax_restarts.print_result(
        {
            "config": args.configs[0],
            "first_step_s": entry["first_step_s"],
            # Building the model and compiling it (artifacts loaded there, NOTE [compile artifacts]).
            "prepare_s": entry["prepare_s"],
            "started_s": started,
            "second_step_s": time.perf_counter() - t0,
            # bucketwise configs: the report's compile times, with its cache lookups.
            "compile_times": entry["compile_breakdown"],
            "first_step": entry["first_step_breakdown"],
        }
    )


def _sizes(args: argparse.Namespace) -> dict[str, int | None]:
    return {f: getattr(args, f) for f in SIZE_FLAGS if getattr(args, f) is not None}


def run(args: argparse.Namespace, device: torch.device) -> None:
    spec = make_spec(args.model, _sizes(args))
    entries: dict[str, dict[str, Any]] = {}
    failed: list[dict[str, Any]] = []
    for i, config in enumerate(args.configs if args.pairs else [], 1):
        print(f"[{i}/{len(args.configs)}] building {config} ...", flush=True)
        try:
            entries[config] = build(config, spec, device, args.backend, args.warmup)
        except Exception as exc:  # noqa: BLE001 - a config that fails is recorded, the others still run
            failed.append({"config": config, "error": f"{type(exc).__name__}: {exc}"[:2000]})
            print(f"    failed: {failed[-1]['error']}", flush=True)
            gc.collect()
            continue
        e = entries[config]
        print(
            f"    first step {e['first_step_s']:.1f} s, at rest {e['rest_bytes'] / 2**20:,.0f} MiB, "
            f"first-steps peak {e['first_peak_bytes'] / 2**20:,.0f} MiB",
            flush=True,
        )

    def save(rows: list[dict[str, Any]], restarts: dict[str, Any] | None = None, *, show: bool = False) -> None:
        if dist.get_rank() != 0:
            return
        meta = _meta(args, device)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows, "restarts": restarts}, f, indent=1)
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write(markdown(meta, rows, restarts))
        if show:
            print(markdown(meta, rows, restarts), flush=True)

    if not entries and not failed:
        rows: list[dict[str, Any]] = []
    else:
        rows = _steady(args, entries, failed, save)
    restarts = None
    if args.restarts:
        from bucketwise.benchmarks.tax import restarts as tax_restarts

        entries.clear()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        extra = [f"--{k}={v}" for k, v in _sizes(args).items()]
        restarts = tax_restarts.run_restarts(args.model, args.configs, args.backend, args.restarts, extra_args=extra)
    save(rows, restarts, show=True)


def _steady(
    args: argparse.Namespace,
    entries: dict[str, dict[str, Any]],
    failed: list[dict[str, Any]],
    save: Callable[[list[dict[str, Any]]], None],
) -> list[dict[str, Any]]:
    """The interleaved rounds and the kernel profiles of the configs built in this process;
    the rounds are saved before the profiles run (a job stopped there keeps them)."""
    at_rest = _allocated()
    built = list(entries)
    for r in range(args.pairs):
        order = built if r % 2 == 0 else built[::-1]
        for config in order:
            timed_block(entries[config], args.steps, at_rest - entries[config]["rest_bytes"])
        print(
            f"round {r + 1}/{args.pairs}: "
            + ", ".join(f"{c} {entries[c]['issue_ms'][-1]:.1f}" for c in built)
            + " ms issue",
            flush=True,
        )
    save(summarize(entries) + failed)
    for config in built:
        kernel_profile(entries[config], args.profile_steps)
    return summarize(entries) + failed


def rewrite_markdown(out: str) -> None:
    """``results.md`` again from ``results.json`` (the docs tables come from the JSON too)."""
    with open(os.path.join(out, "results.json")) as f:
        data = json.load(f)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(markdown(data["meta"], data["rows"], data.get("restarts")))


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    for key, value in (
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29517"),
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("LOCAL_RANK", "0"),
    ):
        os.environ.setdefault(key, value)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("high")
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    if args.first_step_only:
        try:
            first_step_only(args, device)
        finally:
            end_process_group()
        return 0
    try:
        # Every config compiles cold: no compile-cache hit from a config built earlier.
        with torch.compiler.config.patch(force_disable_caches=True):
            # The process's compiler start-up (imports, workers) before the first config's first step.
            x = torch.ones(8, 8, device=device, requires_grad=True)
            torch.compile(lambda t: torch.relu(t @ t) * 2, backend=args.backend)(x).sum().backward()
            # Every config compiled beside the others keeps Dynamo's per-frame budget of its own.
            with side_by_side_compile_limits(len(args.configs)):
                run(args, device)
    finally:
        end_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
