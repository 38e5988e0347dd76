"""Release what holds NCCL kernels before NCCL's communicators are torn down.

NOTE [cuda graphs at teardown]: NCCL cannot destroy a communicator while a CUDA graph that
captured its kernels is alive: ``dist.destroy_process_group()`` waits for those graphs and hangs
(pytorch/pytorch#115388). ``fused`` with ``cudagraphs=True`` captures every bucket's all-reduce,
and the recordings live as long as the compiled module, so a script that ends with
``destroy_process_group()`` would never exit, and nobody should have to free them first. So every
rank of the DDP group also joins a process group of bucketwise's own (a Python backend, no
communication) whose ``shutdown()`` releases every live recording, created so that
``destroy_process_group()``, which shuts groups down last name first, reaches it before the DDP
group (``_compat/c10d.shuts_down_before``); and at interpreter exit the recordings are released
before torch's own teardown (NOTE [at-exit order]). A released recording's runner runs uncaptured
from then on. A release waits a few seconds at most for replays in flight (after Ctrl-C one may
wait for a rank that has stopped), then leaves its recordings to NCCL's abort at process end.
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
    """Call ``release(reason)`` (a bound method, held weakly) before the process groups are
    torn down or the interpreter exits."""
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

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)

    def getBackendName(self) -> str:  # noqa: N802 - c10d's name
        return _BACKEND

    def shutdown(self) -> None:
        release_all("destroy_process_group()")


def guard(pg: Any) -> None:
    """Make ``destroy_process_group()`` release CUDA graphs before it tears ``pg`` down (a
    collective over ``pg``'s ranks, once per group: call it on each of them)."""
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
