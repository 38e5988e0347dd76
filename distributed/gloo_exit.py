"""Give gloo's worker threads the GIL once more before the interpreter finalizes.

NOTE [gloo at exit]: every gloo collective is run by one of the group's ``pt_gloo_runloop``
threads, and the work object it frees afterwards holds a copy of the issuing thread's Python
context (``at::ThreadLocalState`` keeps the ``contextvars.Context``), so freeing it takes the GIL.
Once the interpreter is finalizing, a thread that asks for the GIL is made to exit, and that exit
unwinds through a ``noexcept`` destructor: ``terminate called without an active exception``
(torch 2.13.0, pytorch/pytorch#190489), and torchrun fails the job of a rank that trained
correctly. So the last at-exit phase (NOTE [at-exit order]) sleeps ``SETTLE_S``, GIL released,
when a job compiled a DDP model over a gloo group, so that the thread finishes before
finalization starts. NCCL groups free their work without Python. A group ended with
``destroy_process_group()`` right after its last collective is freed there and then, while a gloo
thread may still need the GIL the main thread holds: that rank hangs, so ``end_process_group()``
waits first.
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
