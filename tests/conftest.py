"""Shared fixtures of the bucketwise test suite.

In-process tests share one interpreter per xdist worker, so Dynamo's caches and counters are
reset around every test; multi-process tests (tests/_dist.py) start fresh interpreters and
need none of this.
"""

from __future__ import annotations

import datetime
import os
import sys

import pytest
import torch
import torch._dynamo
import torch.distributed as dist

# tests/ on sys.path so test modules can `import _dist` (also inherited by spawned workers).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Fresh Dynamo caches per test, a deterministic seed, and no leaked Dynamo setting."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    optimize_ddp = torch._dynamo.config.optimize_ddp
    yield
    torch._dynamo.reset()
    # A test must not leak a global Dynamo setting into the next one.
    torch._dynamo.config.optimize_ddp = optimize_ddp


@pytest.fixture
def single_rank_group(tmp_path):
    """A one-rank gloo process group in this process (file store in tmp_path), destroyed after.

    Enough for tests that need a real DDP reducer but no cross-rank traffic.
    """
    if dist.is_initialized():  # pragma: no cover - a previous test leaked its group
        dist.destroy_process_group()
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp_path}/single_rank_store",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        yield dist.group.WORLD
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture
def dynamo_counters():
    """Dynamo's global counters (``torch._dynamo.utils.counters``)."""
    from torch._dynamo.utils import counters

    return counters
