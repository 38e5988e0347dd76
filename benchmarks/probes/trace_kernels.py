"""GPU time per step by kernel kind, from the profiler traces a ``ddp --keep-traces`` run kept, and
the kinds whose time differs most between its first config and each other one (one rank).

    python -m bucketwise.benchmarks probe trace_kernels OUT [--rank 0] [--steps 3]

Kinds: NCCL, GEMMs, attention, each Triton kernel by its fused ops, any other kernel by name.
Written for ``results/2026-11-28_2xH200_gpt-medium-b8-kernels-under-overlap`` (``kern.txt``):
where the overlap's time goes when the host plays no part (CUDA-graph configs).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
from pathlib import Path

from bucketwise.stats.trace_analysis import length, merge

TRITON = re.compile(r"triton_(\w+?)_fused_(.*?)(_\d+)?$")


def kind(name: str) -> str:
    low = name.lower()
    if "nccl" in low:
        return "nccl"
    if "gemm" in low or "cutlass" in low or "sm90" in name or "nvjet" in name:
        return "gemm"
    if "flash" in low or "fmha" in low or "attention" in low:
        return "attn"
    if name.startswith("triton_"):
        m = TRITON.match(name)
        return f"triton:{m.group(1)}:{m.group(2)[:60]}" if m else name[:60]
    return name[:70]


def busy_ms(spans: list[tuple[float, float]]) -> float:
    """Milliseconds in which at least one of ``spans`` (microseconds) runs."""
    return length(merge(spans)) / 1e3


def per_step(path: Path, steps: int) -> tuple[collections.Counter, collections.Counter, float, int]:
    """Milliseconds and counts per step by kind, compute-busy ms per step, kernels per step."""
    kernels = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("cat") == "kernel"]
    ms, count = collections.Counter(), collections.Counter()
    for e in kernels:
        k = kind(e["name"])
        ms[k] += e["dur"] / 1e3 / steps
        count[k] += 1 / steps
    compute = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" not in e["name"].lower()]
    return ms, count, busy_ms(compute) / steps, round(len(kernels) / steps)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="the --out folder of a `ddp --keep-traces` run")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--steps", type=int, default=3, help="the run's --profile-steps (default 3)")
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args(argv)
    suffix = f"-rank{args.rank}.json"
    traces = sorted((args.out / "traces").glob(f"*{suffix}"))
    if not traces:
        p.error(f"no traces of rank {args.rank} under {args.out / 'traces'}: run `ddp` with --keep-traces")
    found = {}
    for path in traces:
        config = path.name[: -len(suffix)]
        ms, count, busy, n = found[config] = per_step(path, args.steps)
        print(
            f"{config}: kernels/step {n}, kernel ms/step {sum(ms.values()):.2f}, "
            f"compute busy ms/step {busy:.2f}, nccl ms/step {ms['nccl']:.2f}"
        )
    base, *others = found
    for other in others:
        print(f"\n== {other} minus {base}: kinds by ms/step difference")
        a, ca = found[base][:2]
        b, cb = found[other][:2]
        for k in sorted(set(a) | set(b), key=lambda k: -abs(b[k] - a[k]))[: args.top]:
            print(f"{b[k] - a[k]:+8.3f} ms  {cb[k] - ca[k]:+6.1f} n   {a[k]:8.3f} -> {b[k]:8.3f}  {k}")
    return 0
