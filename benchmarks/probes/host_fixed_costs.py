"""The fixed host costs of a DDP step that no kernel explains: all-reduces traced into a compiled
graph at world size 1, eager DDP's forward wrapper, and the default's forward beside ``local``'s
(one rank).

    python -m bucketwise.benchmarks probe host_fixed_costs [--rounds 7] [--calls 200] [--out DIR]

Each line times its candidates in ``--rounds`` interleaved rounds (direction alternating), each
round 3 blocks of ``--calls`` calls, the GPU synchronized between blocks only, and prints the
median host microseconds per call. The collectives run on four buffers the sizes of the default's
buckets on HF Llama 8 layers, each ``dist.all_reduce`` compiled with ``fullgraph=True`` as
Dynamo traces it into a backward (beside a compiled graph of one tiny kernel, the graph's own
call cost); the forwards on a two-layer MLP (64 wide, batch 8), small enough that the kernels cost
almost nothing. ``--out`` writes ``results.json``: the run's meta and every line. Without a GPU,
one gloo rank on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import bucketwise
from bucketwise.benchmarks.core.meta import run_meta
from bucketwise.benchmarks.probes._one_rank import one_rank
from bucketwise.benchmarks.tax.bench import sync

BUCKET_NUMELS = (41_500_000, 41_500_000, 41_500_000, 20_000_000)
"""The default's four buckets on HF Llama 8 layers (elements, fp32)."""
BLOCKS = 3
"""Timed blocks per candidate per round."""


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def per_call_us(fn: Callable[[], object], calls: int) -> list[float]:
    out = []
    for _ in range(BLOCKS):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - start) / calls * 1e6)
        sync()
    return out


def interleaved(title: str, fns: dict[str, Callable[[], object]], *, rounds: int, calls: int) -> dict[str, float]:
    """Median host microseconds per call of each candidate, the candidates interleaved per round."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(rounds):
        order = list(fns.items()) if r % 2 == 0 else list(reversed(fns.items()))
        for name, fn in order:
            times[name] += per_call_us(fn, calls)
    medians = {k: round(statistics.median(v), 1) for k, v in times.items()}
    print(title, medians, flush=True)
    return medians


def collectives(device: torch.device, *, rounds: int, calls: int) -> dict[str, float]:
    numels = BUCKET_NUMELS if device.type == "cuda" else (1000,) * len(BUCKET_NUMELS)
    bufs = [torch.zeros(n, device=device) for n in numels]

    def all_reduce(bufs: list[torch.Tensor]) -> None:
        for b in bufs:
            dist.all_reduce(b, op=dist.ReduceOp.AVG)

    def tiny(bufs: list[torch.Tensor]) -> None:
        bufs[-1][:8].add_(0)

    compiled = {
        "compiled, one tiny kernel": (torch.compile(tiny, fullgraph=True), bufs),
        "compiled, 1 all-reduce": (torch.compile(all_reduce, fullgraph=True), bufs[:1]),
        "compiled, 4 all-reduces": (torch.compile(all_reduce, fullgraph=True), bufs),
        "eager, 4 all-reduces": (all_reduce, bufs),
    }
    for fn, args in compiled.values():
        fn(args)  # compile
    candidates = {k: (lambda fn=fn, args=args: fn(args)) for k, (fn, args) in compiled.items()}
    return interleaved("collectives (us per call)", candidates, rounds=rounds, calls=calls)


def forwards(device: torch.device, *, rounds: int, calls: int) -> dict[str, dict[str, float]]:
    models = {
        "module": Tiny().to(device),
        "eager DDP": DDP(Tiny().to(device)),
        "local": torch.compile(Tiny().to(device)),
        "bw-auto": bucketwise.compile(DDP(Tiny().to(device))),
        "torch.compile(DDP)": torch.compile(DDP(Tiny().to(device))),
    }
    x = torch.randn(8, 64, device=device)
    for model in models.values():
        for _ in range(3):  # compile and warm
            model(x).sum().backward()
    fwd = {k: (lambda m=m: m(x)) for k, m in models.items()}
    step = {k: (lambda m=m: m(x).sum().backward()) for k, m in models.items()}
    out = {
        "forward only, grad enabled (us)": interleaved(
            "forward only, grad enabled (us)", fwd, rounds=rounds, calls=calls
        ),
        "forward+backward (us)": interleaved("forward+backward (us)", step, rounds=rounds, calls=calls),
    }
    with torch.no_grad():
        no_grad = {k: fwd[k] for k in ("local", "bw-auto")}
        out["forward, no_grad (us)"] = interleaved("forward, no_grad (us)", no_grad, rounds=rounds, calls=calls)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds per line")
    p.add_argument("--calls", type=int, default=200, help="calls per timed block")
    p.add_argument("--out", help="a folder to write results.json to: the run's meta and every line")
    args = p.parse_args(argv)
    with one_rank(p, [], port=29611, needs_gpu=False) as device:
        lines = {"collectives (us per call)": collectives(device, rounds=args.rounds, calls=args.calls)}
        lines |= forwards(device, rounds=args.rounds, calls=args.calls)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        meta = {**run_meta(), "rounds": args.rounds, "calls": args.calls, "blocks": BLOCKS}
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"meta": meta, "us_per_call": lines}, f, indent=1)
    return 0
