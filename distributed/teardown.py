"""Release what holds NCCL kernels before NCCL's communicators are torn down.

NOTE [cuda graphs at teardown]: ``destroy_process_group()`` hangs while a CUDA graph that captured
NCCL kernels is alive (pytorch/pytorch#115388), and ``fused`` with ``cudagraphs=True`` captures
every all-reduce. So each DDP group gets a companion group of ours (Python backend, no
communication) whose ``shutdown()`` releases every recording, named so that
``destroy_process_group()`` reaches it first (``_compat/c10d.shuts_down_before``); at
interpreter exit they are released before torch's teardown (NOTE [at-exit order]). Released
runners run uncaptured; a release waits a few seconds at most for replays in flight.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable

import torch.distributed as dist

from .._compat import c10d as c10c
from .at_exit import at_exit

log = logging.getLogger(__name__)

_BACKEND = "bucketwise_release"
_MAX_TRIES = 8
"""Release groups created (each under a new name) until one shuts down before the DDP group."""

# The release groups made for each DDP process group.
_release_groups: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


class _Releaser:
    """A weakly held ``release(reason)`` method of a CUDA-graph group."""

    def __init__(self, release: Callable[[str], None]) -> None:
        self.method = weakref.WeakMethod(release)

    def __call__(self, reason: str) -> None:
        release = self.method()
        if release is not None:
            release(reason)


# Release callbacks of live CUDA-graph groups (a group that is garbage-collected drops out).
_keep: list[_Releaser] = []


def on_teardown(release: Callable[[str], None]) -> None:
    """Call ``release(reason)`` (held weakly) before group teardown or interpreter exit."""
    releaser = _Releaser(release)
    _keep[:] = [r for r in _keep if r.method() is not None] + [releaser]
    at_exit("cuda graphs", _release_at_exit)


def _release_at_exit() -> None:
    release_all("interpreter exit")


def release_all(reason: str) -> None:
    """Release every registered CUDA-graph group now (also the manual, early way)."""
    for releaser in list(_keep):
        releaser(reason)
    _keep[:] = [r for r in _keep if r.method() is not None]


class _ReleaseGroup(dist.ProcessGroup):
    """No communication: ``destroy_process_group()`` calls its ``shutdown()``, which releases."""

    def getBackendName(self) -> str:  # noqa: N802 - c10d's name
        return _BACKEND

    def shutdown(self) -> None:
        release_all("destroy_process_group()")


def guard(pg: Any) -> None:
    """Make ``destroy_process_group()`` release CUDA graphs before ``pg`` (collective on ``pg``)."""
    if pg in _release_groups:
        return
    if not hasattr(dist.Backend, _BACKEND.upper()):
        dist.Backend.register_backend(
            _BACKEND, lambda store, rank, size, timeout: _ReleaseGroup(rank, size), devices=["cpu", "cuda"]
        )
    ranks = dist.get_process_group_ranks(pg)
    made = []
    with c10c.default_device_unbound():
        for _ in range(_MAX_TRIES):
            made.append(dist.new_group(ranks=ranks, backend=_BACKEND, use_local_synchronization=True))
            if c10c.shuts_down_before(made[-1], pg):
                break
        else:
            log.warning(
                "bucketwise: could not place the CUDA-graph release before the DDP process group's "
                "teardown; release CUDA graphs (bucketwise.cudagraphs.runner) before destroy_process_group()"
            )
    _release_groups[pg] = made
