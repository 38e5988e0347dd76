"""What the one-rank probes share: their configs checked, then one rank of one."""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from bucketwise.benchmarks.core.configs import recipe_for


def check(p: argparse.ArgumentParser, configs: Sequence[str], *, needs_gpu: bool = True) -> None:
    """Exit through ``p.error`` on an unknown config, or without a GPU where ``needs_gpu``."""
    for c in configs:
        try:
            recipe_for(c)
        except ValueError as exc:
            p.error(f"--configs: {exc}")
    if needs_gpu and not torch.cuda.is_available():
        p.error("needs a GPU")


@contextlib.contextmanager
def one_rank(
    p: argparse.ArgumentParser, configs: Sequence[str], *, port: int, needs_gpu: bool = True
) -> Iterator[torch.device]:
    """:func:`check`, then rank 0 of a world of one for the duration: NCCL on GPU 0, gloo on the
    CPU where there is no GPU, on ``MASTER_PORT`` ``port`` unless one is set."""
    check(p, configs, needs_gpu=needs_gpu)
    cuda = torch.cuda.is_available()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    try:
        yield device
    finally:
        dist.destroy_process_group()
