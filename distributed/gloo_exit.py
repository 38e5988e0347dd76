"""Give gloo's worker threads the GIL once more before the interpreter finalizes.

NOTE [gloo at exit]: a gloo collective runs on a ``pt_gloo_runloop`` thread, and freeing its work
object takes the GIL (it holds the issuing thread's ``contextvars.Context``). A thread that asks
for the GIL during finalization is made to exit through a ``noexcept`` destructor: ``terminate
called without an active exception`` (torch 2.13.0, pytorch/pytorch#190489), failing a rank that
trained correctly. So the last at-exit phase (NOTE [at-exit order]) sleeps ``SETTLE_S``, GIL
released, when a DDP model was compiled over a gloo group; NCCL frees its work without Python.
``destroy_process_group()`` right after a collective can hang the same way (the main thread holds
the GIL), so ``end_process_group()`` waits first.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch.distributed as dist

from .at_exit import at_exit

log = logging.getLogger(__name__)

SETTLE_S = 0.5
"""How long the interpreter waits at exit, GIL released, for gloo threads still freeing work."""


def uses_gloo(pg: Any) -> bool:
    """Is ``pg`` a gloo group (``"gloo"``, or gloo for one device type of several)?"""
    try:
        return "gloo" in str(dist.get_backend(pg))
    except (RuntimeError, ValueError):  # not a registered group (destroyed, or never made)
        return False


def settle_at_exit(pg: Any) -> None:
    """If ``pg`` is a gloo group, wait ``SETTLE_S`` at interpreter exit (NOTE [gloo at exit])."""
    if uses_gloo(pg):
        at_exit("gloo threads", _settle)


def end_process_group() -> None:
    """``dist.destroy_process_group()``, after ``SETTLE_S`` on a gloo group (NOTE [gloo at exit])."""
    if not dist.is_initialized():
        return
    if uses_gloo(None):
        _settle()
    dist.destroy_process_group()


def _settle() -> None:
    log.debug("bucketwise: at exit: %.1f s for gloo threads to free their last work", SETTLE_S)
    time.sleep(SETTLE_S)
