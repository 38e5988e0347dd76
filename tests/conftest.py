"""Shared fixtures of the bucketwise test suite.

In-process tests share one interpreter per xdist worker, so Dynamo's caches and counters are
reset around every test; multi-process tests (tests/support/dist.py) start fresh interpreters and
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

# tests/ on sys.path so test modules can `import support.dist` (also inherited by spawned workers).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from support.torch_state import config_changes, config_snapshot, process_changes, process_snapshot  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Fresh Dynamo caches per test and a deterministic seed; the test fails if it left any
    torch config option changed or missing (change them with the config module's own
    ``patch()``, see tests/support/torch_state.py)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    before, shared = config_snapshot(), process_snapshot()
    yield
    torch._dynamo.reset()
    changes = config_changes(before, config_snapshot())
    if changes:
        pytest.fail(
            "this test left torch's config changed (use the config module's patch(), never assignment or "
            "monkeypatch):\n  " + "\n  ".join(changes),
            pytrace=False,
        )
    changes = process_changes(shared, process_snapshot())
    if changes:
        pytest.fail("this test left the process changed for later tests:\n  " + "\n  ".join(changes), pytrace=False)


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
