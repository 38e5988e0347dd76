"""Where a CUDA-graphed step's host time goes: the host's own work, or waiting for room in the
GPU's command buffer (one rank, one GPU).

    python -m bucketwise.benchmarks probe graph_launch [--model llama] [--layers 32] \\
        [--configs bw-fused-cg,bw-fused-blocks-cg] [--out DIR]

Per config, in interleaved rounds of back-to-back steps: the time to issue a step, the
process's CPU time (NOTE [a step's CPU time]), and the step time; then one step issued with the GPU idle (the host's own
work, nothing to wait for); then, under the profiler, the host's time in "Command Buffer Full"
(waiting for the GPU to take more work) and in ``cudaGraphLaunch`` per launch. Where the
back-to-back issue time is above the idle one by about the command-buffer waits, the difference
is the GPU's, not the host's. Writes ``results.json`` under ``--out``; ``--profile N`` then
prints where the host's own work goes (cProfile of N steps, each issued from an idle GPU).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import time
from typing import Any, Callable

import torch
from torch.profiler import ProfilerActivity, profile

from bucketwise.benchmarks.core import metrics as bm
from bucketwise.benchmarks.core.configs import recipe_for
from bucketwise.benchmarks.core.meta import run_meta
from bucketwise.benchmarks.core.models import MODELS, make_spec
from bucketwise.benchmarks.core.step import training_step
from bucketwise.benchmarks.probes._one_rank import one_rank

STEPS = 20
IDLE_SAMPLES = 5
PROFILED_STEPS = 5
BUFFER_FULL = "Command Buffer Full"
GRAPH_LAUNCH = "cudaGraphLaunch"


def back_to_back(step: Callable[[], Any]) -> dict[str, float]:
    """``STEPS`` steps without a sync between them: ms per step to issue, of the process's CPU
    time (NOTE [a step's CPU time]), and to finish."""
    torch.cuda.synchronize()
    t0, c0 = time.perf_counter(), bm.process_cpu_s()
    for _ in range(STEPS):
        step()
    t1, c1 = time.perf_counter(), bm.process_cpu_s()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return {
        "issue_ms": (t1 - t0) / STEPS * 1e3,
        "process_cpu_ms": (c1 - c0) / STEPS * 1e3,
        "step_ms": (t2 - t0) / STEPS * 1e3,
    }


def from_idle(step: Callable[[], Any]) -> float:
    """Median ms to issue one step with the GPU idle before it."""
    samples = []
    for _ in range(IDLE_SAMPLES):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        samples.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(samples)


def idle_profile(step: Callable[[], Any], steps: int) -> str:
    """cProfile of ``steps`` steps, each issued with the GPU idle: the host's own work, by
    function (the 30 largest by own time, then by cumulative time)."""
    prof = cProfile.Profile()
    for _ in range(steps):
        torch.cuda.synchronize()
        prof.enable()
        step()
        prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(60)
    return text.getvalue()


def host_waits(step: Callable[[], Any]) -> dict[str, float | None]:
    """Under the profiler, ``PROFILED_STEPS`` steps back to back: the host's ms per step in
    command-buffer waits, and per ``cudaGraphLaunch``."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_STEPS):
            step()
        torch.cuda.synchronize()
    by_name = {e.key: e for e in prof.key_averages()}
    full, launch = by_name.get(BUFFER_FULL), by_name.get(GRAPH_LAUNCH)
    return {
        "buffer_full_ms_per_step": full.self_cpu_time_total / 1e3 / PROFILED_STEPS if full else 0.0,
        "graph_launches_per_step": launch.count / PROFILED_STEPS if launch else 0.0,
        "graph_launch_ms": launch.self_cpu_time_total / 1e3 / launch.count if launch else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama", choices=sorted(MODELS))
    p.add_argument("--layers", type=int, default=None, help="the model's depth (default: the model's own)")
    p.add_argument("--configs", default="bw-fused-cg,bw-fused-blocks-cg", help="comma-separated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None, help="folder for results.json")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="then print cProfile of N idle steps per config")
    args = p.parse_args(argv)
    configs = args.configs.split(",")
    with one_rank(p, configs, port=29576) as device:
        spec = make_spec(args.model, {"layers": args.layers})
        steps = {}
        for c in configs:
            steps[c] = training_step(recipe_for(c), spec, device, "inductor")[3]
            for _ in range(5):  # compile, record, warm
                steps[c]()
        rounds: dict[str, list[dict[str, float]]] = {c: [] for c in configs}
        for r in range(args.rounds):
            for c in configs if r % 2 == 0 else configs[::-1]:
                rounds[c].append(back_to_back(steps[c]))
                print(f"round {r + 1} {c}: " + ", ".join(f"{k} {v:.2f}" for k, v in rounds[c][-1].items()), flush=True)
        rows = []
        for c in configs:
            row = {"config": c, "rounds": rounds[c], "idle_issue_ms": from_idle(steps[c]), **host_waits(steps[c])}
            for key in ("issue_ms", "process_cpu_ms", "step_ms"):
                row[f"{key}_median"] = statistics.median(x[key] for x in rounds[c])
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "rounds"}), flush=True)
        for c in configs if args.profile else ():
            print(f"== {c}: cProfile of {args.profile} steps issued from an idle GPU", flush=True)
            print(idle_profile(steps[c], args.profile), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        meta = {**run_meta(), "model": args.model, "layers": args.layers, "steps": STEPS, "rounds": args.rounds}
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0
