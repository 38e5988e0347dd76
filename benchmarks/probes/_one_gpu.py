"""What the one-GPU probes share: their configs checked, then one rank of one over NCCL."""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from bucketwise.benchmarks.core.configs import recipe_for


@contextlib.contextmanager
def one_gpu_rank(p: argparse.ArgumentParser, configs: Sequence[str], *, port: int) -> Iterator[torch.device]:
    """Exit through ``p.error`` on an unknown config or without a GPU; else rank 0 of a world of
    one (NCCL, GPU 0) for the duration, on ``MASTER_PORT`` ``port`` unless one is set."""
    for c in configs:
        try:
            recipe_for(c)
        except ValueError as exc:
            p.error(f"--configs: {exc}")
    if not torch.cuda.is_available():
        p.error("needs a GPU")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        yield torch.device("cuda", 0)
    finally:
        dist.destroy_process_group()
