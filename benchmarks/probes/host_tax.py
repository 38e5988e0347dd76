"""Where a config's host time per step goes beyond its floor's: CPU ops, CUDA runtime calls and
Python functions per step, side by side (one rank, one GPU).

    python -m bucketwise.benchmarks probe host_tax --model llama --layers 16 \
        --configs local,bw-auto,bw-auto@400 --out DIR

``CONFIG@MIB`` builds a config with DDP's ``bucket_cap_mb=MIB`` (the bucket count's share of the
tax). Every config is built once in the same process (``tax``'s ``build``), then timed in
interleaved rounds (``tax``'s ``timed_block``: host issue time and GPU time per step), then
profiled: ``torch.profiler`` (kernels, GPU kernel time, self CPU time and calls per step of every
CPU op and CUDA runtime call), ``cProfile`` (Python functions), and one step under
``torch.cuda.set_sync_debug_mode("warn")`` (device-to-host syncs per step). ``results.json`` has
every figure; ``results.md`` the ops whose host time per step differs most from the first
config's.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import warnings
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from bucketwise.benchmarks.core.meta import run_meta
from bucketwise.benchmarks.core.models import MODELS, make_spec
from bucketwise.benchmarks.probes._one_gpu import one_gpu_rank
from bucketwise.benchmarks.tax.bench import build, kernel_profile, timed_block

STEPS = 3
"""Profiled steps per config."""
TOP = 30


def parse_config(name: str) -> tuple[str, float | None]:
    """``bw-auto@400`` -> ``("bw-auto", 400.0)``; ``local`` -> ``("local", None)``."""
    config, _, cap = name.partition("@")
    return config, float(cap) if cap else None


def host_ops(step: Any) -> dict[str, dict[str, float]]:
    """Calls and self CPU microseconds per step of every CPU op and CUDA runtime call."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize()
    out: dict[str, dict[str, float]] = {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            continue
        out[e.key] = {"calls": e.count / STEPS, "self_us": e.self_cpu_time_total / STEPS}
    return out


def python_functions(step: Any) -> dict[str, dict[str, float]]:
    """Calls and own seconds per step of every Python function (cProfile)."""
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(STEPS):
        step()
    torch.cuda.synchronize()
    prof.disable()
    out = {}
    for (path, line, fn), (_, calls, own, _, _) in pstats.Stats(prof).stats.items():
        out[f"{path.split('site-packages/')[-1]}:{line}({fn})"] = {"calls": calls / STEPS, "self_us": own * 1e6 / STEPS}
    return out


def syncs_per_step(step: Any) -> list[str]:
    """The device-to-host syncs of one step, as ``set_sync_debug_mode("warn")`` reports them."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return [str(w.message)[:200] for w in caught if "synchroniz" in str(w.message)]


def _diff_table(title: str, base: dict[str, dict[str, float]], other: dict[str, dict[str, float]]) -> list[str]:
    keys = set(base) | set(other)
    zero = {"calls": 0.0, "self_us": 0.0}
    rows = sorted(keys, key=lambda k: -abs(other.get(k, zero)["self_us"] - base.get(k, zero)["self_us"]))[:TOP]
    lines = [
        f"### {title}",
        "",
        "| name | calls | floor calls | self us | floor self us |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for k in rows:
        a, b = base.get(k, zero), other.get(k, zero)
        lines.append(f"| `{k[:110]}` | {b['calls']:.1f} | {a['calls']:.1f} | {b['self_us']:.0f} | {a['self_us']:.0f} |")
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama", choices=MODELS)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--configs", default="local,bw-auto")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed steps per config per round")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    names = args.configs.split(",")
    sizes = {k: v for k, v in (("layers", args.layers), ("batch", args.batch)) if v is not None}
    spec = make_spec(args.model, sizes)
    with one_gpu_rank(p, [parse_config(n)[0] for n in names], port=29541) as device:
        torch.set_float32_matmul_precision("high")
        entries = {}
        for name in names:
            config, cap = parse_config(name)
            entries[name] = build(config, spec, device, "inductor", warmup=3, bucket_cap_mb=cap)
            print(f"built {name}: first step {entries[name]['first_step_s']:.1f} s", flush=True)
        at_rest = torch.cuda.memory_allocated()
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                timed_block(entries[name], args.steps, at_rest - entries[name]["rest_bytes"])
            print(f"round {r + 1}: " + ", ".join(f"{n} {entries[n]['step_ms'][-1]:.2f}" for n in names), flush=True)
        rows = []
        for name in names:
            e = entries[name]
            kernel_profile(e, STEPS)
            row = {
                "config": name,
                "issue_ms": e["issue_ms"],
                "step_ms": e["step_ms"],
                "issue_ms_median": statistics.median(e["issue_ms"]),
                "process_cpu_ms": e["process_cpu_ms"],
                "process_cpu_ms_median": statistics.median(e["process_cpu_ms"]),
                "cpu_ms": e["cpu_ms"],
                "cpu_ms_median": statistics.median(e["cpu_ms"]),
                "step_ms_median": statistics.median(e["step_ms"]),
                "kernels": e["kernels"],
                "gpu_ms": e["gpu_ms"],
                "gpu_idle_ms": e["gpu_idle_ms"],
                "idle_before_ms": e["idle_before_ms"],
                "buckets": len(e["report"].graphs[0].buckets)
                if e["report"] is not None and e["report"].graphs
                else None,
                "syncs": syncs_per_step(e["step"]),
                "ops": host_ops(e["step"]),
                "python": python_functions(e["step"]),
            }
            rows.append(row)
            print(
                f"{name}: step {row['step_ms_median']:.2f} ms, issue {row['issue_ms_median']:.2f} ms, "
                f"CPU time {row['process_cpu_ms_median']:.2f} ms, "
                f"GPU {row['gpu_ms']:.2f} ms (idle {row['gpu_idle_ms']:.2f}), {row['kernels']:.0f} kernels, "
                f"buckets {row['buckets']}, "
                f"syncs {len(row['syncs'])}",
                flush=True,
            )
    os.makedirs(args.out, exist_ok=True)
    meta = {**run_meta(), "model": spec.describe(), "configs": names, "rounds": args.rounds, "steps": args.steps}
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [f"# host time per step: {args.model} {sizes}", ""]
    lines += [
        f"- `{r['config']}`: step {r['step_ms_median']:.2f} ms, issue {r['issue_ms_median']:.2f} ms, CPU time "
        f"{r['process_cpu_ms_median']:.2f} ms, GPU "
        f"{r['gpu_ms']:.2f} ms, {r['kernels']:.0f} kernels, buckets {r['buckets']}, syncs {r['syncs'][:2]}"
        for r in rows
    ]
    lines.append("")
    for r in rows[1:]:
        lines += _diff_table(f"`{r['config']}` against `{rows[0]['config']}`: CPU ops", rows[0]["ops"], r["ops"])
        lines += _diff_table(f"`{r['config']}` against `{rows[0]['config']}`: Python", rows[0]["python"], r["python"])
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines), flush=True)
    return 0
