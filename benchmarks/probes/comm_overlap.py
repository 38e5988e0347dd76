"""What an all-reduce running beside compute costs the compute: a stream of bf16 matmuls timed
alone and beside 16 all-reduces of 97 MiB fp32 buckets (gpt-medium's 1,550 MiB of gradients) on
a second stream; sum and average over ordinary buffers, and over buffers NCCL registered as
symmetric windows (its symmetric kernels, NCCL >= 2.27), in interleaved rounds.

    torchrun --standalone --nproc-per-node 4 -m bucketwise.benchmarks probe comm_overlap --out DIR

``main_ms``: the matmul stream from its first kernel to its last (the compute's time beside the
traffic); ``comm_ms``: the all-reduces' stream over the same span; both the slowest rank's median.
Behind ``results/2026-11-28_4xH200_comm-overlap-symmetric-windows``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Any

import torch
import torch.distributed as dist

from bucketwise._compat import collectives as cc

BUCKETS, BUCKET_MIB, MATMULS = 16, 97, 30


def _timed(
    mode: str, a: torch.Tensor, b: torch.Tensor, buckets: Any, op: Any, side: Any, iters: int
) -> tuple[float, float]:
    """Median (main stream, comm stream) milliseconds over ``iters`` runs after 2 untimed ones."""
    out = []
    for i in range(iters + 2):
        dist.barrier()
        torch.cuda.synchronize()
        start, end, comm_start, comm_end = (torch.cuda.Event(enable_timing=True) for _ in range(4))
        start.record()
        if mode in ("overlap", "comm"):
            side.wait_event(start)
            with torch.cuda.stream(side):
                comm_start.record(side)
                for t in buckets:
                    dist.all_reduce(t, op=op)
                comm_end.record(side)
        if mode in ("overlap", "compute"):
            for _ in range(MATMULS):
                torch.mm(a, b)
        end.record()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        if i >= 2:
            out.append((start.elapsed_time(end), comm_start.elapsed_time(comm_end) if mode != "compute" else 0.0))
    return statistics.median(x[0] for x in out), statistics.median(x[1] for x in out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--out", default=None, help="folder for overlap_w<WORLD>.json (rank 0)")
    args = p.parse_args(argv)
    if "RANK" not in os.environ or not torch.cuda.is_available():
        p.error("run under torchrun on GPUs (NCCL)")
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", device_id=dev)
    numel = BUCKET_MIB * 2**20 // 4
    plain = [torch.ones(numel, device=dev) for _ in range(BUCKETS)]
    symm = cc.symmetric_buffers(dist.group.WORLD, [numel] * BUCKETS, dev)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    side = torch.cuda.Stream(priority=-1)
    SUM, AVG = dist.ReduceOp.SUM, dist.ReduceOp.AVG
    cases = [("compute", "compute", None, None)]
    for kind, bufs in (("plain", plain), ("symm", symm)):
        for name, op in (("sum", SUM), ("avg", AVG)):
            cases += [(f"comm-{kind}-{name}", "comm", bufs, op), (f"overlap-{kind}-{name}", "overlap", bufs, op)]
    rows = []
    for rnd in range(args.rounds):
        for name, mode, bufs, op in cases:
            main_ms, comm_ms = _timed(mode, a, b, bufs, op, side, args.iters)
            t = torch.tensor([main_ms, comm_ms], device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            rows.append(dict(round=rnd, config=name, main_ms=t[0].item(), comm_ms=t[1].item()))
            if rank == 0:
                print(f"r{rnd} {name:20s} main {t[0].item():8.2f} ms  comm {t[1].item():8.2f} ms", flush=True)
    if rank == 0 and args.out:
        os.makedirs(args.out, exist_ok=True)
        meta = dict(world=dist.get_world_size(), nccl=list(torch.cuda.nccl.version()), torch=torch.__version__)
        path = os.path.join(args.out, f"overlap_w{dist.get_world_size()}.json")
        with open(path, "w") as f:
            json.dump(dict(meta, bucket_mib=BUCKET_MIB, buckets=BUCKETS, matmuls=MATMULS, rows=rows), f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
