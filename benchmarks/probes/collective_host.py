"""Host time of one collective call on one rank (NCCL, one GPU): the functional all-reduce and
its wait as a compiled ``fused`` backward issues them, ``dist.all_reduce``, and an empty
kernel launch for scale; small and large buffers.

    python -m bucketwise.benchmarks probe collective_host

Run it once as it is and once with ``TORCH_FR_BUFFER_SIZE=0`` (no flight recorder): it
prints one JSON object with the environment it ran under. Behind
``results/2026-11-28_1xH200_collective-host-time-llama8``, which corrected the 70-100 us per
collective that cProfile had put on ``all_reduce_`` inside a training step.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Callable

import torch
import torch.distributed as dist

from bucketwise._compat import collectives as cc
from bucketwise.benchmarks.probes._one_gpu import one_gpu_rank

ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_ENABLE_TIMING", "TORCH_NCCL_DESYNC_DEBUG")
SIZES = (1 << 10, 64 << 20)


def host_us(fn: Callable[[], object], calls: int) -> float:
    """Host microseconds per call of ``fn``, the GPU left to catch up only before and after."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return round(elapsed / calls * 1e6, 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000, help="calls timed per case (a quarter for large buffers)")
    args = p.parse_args(argv)
    with one_gpu_rank(p, (), port=29578):
        group = cc.group_name(dist.group.WORLD)
        out: dict[str, object] = {"env": {k: os.environ.get(k) for k in ENV}, "torch": torch.__version__}
        for numel in SIZES:
            t = torch.ones(numel, device="cuda")
            cases = {
                "functional all_reduce_+wait": lambda t=t: cc.all_reduce_sum_(t, group),
                "functional all_reduce+wait": lambda t=t: cc.all_reduce(t, group),
                "dist.all_reduce": lambda t=t: dist.all_reduce(t),
                "empty launch (t.add_(0))": lambda t=t: t.add_(0),
            }
            calls = args.calls if numel <= 1 << 20 else args.calls // 5
            for name, fn in cases.items():
                out[f"{name} numel={numel}"] = host_us(fn, calls)
        print(json.dumps(out, indent=1))
    return 0
