"""One zoo model on this rank: its check (``zoo.train``) or its speed run (``zoo.speed``)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from bucketwise.benchmarks.zoo.registry import get
from bucketwise.benchmarks.zoo.speed import run_speed
from bucketwise.benchmarks.zoo.train import run_check


def run_model(rank: int, world_size: int, name: str, opts: dict[str, Any]) -> dict[str, Any]:
    spec = get(name)
    if opts["mode"] == "speed":
        configs = run_speed(spec, rank, opts)
    else:
        configs = run_check(spec, rank, opts)
    return {"model": name, "rank": rank, "world_size": world_size, "configs": configs}


def worker(rank: int, world_size: int, name: str, opts: dict[str, Any]) -> dict[str, Any]:
    """``run_model`` with the process group's barrier around it (used by tests/support/dist.py)."""
    dist.barrier()
    return run_model(rank, world_size, name, opts)
