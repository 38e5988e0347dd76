"""Give gloo's worker threads the GIL once more before the interpreter finalizes.

NOTE [gloo at exit]: every gloo collective is run by one of the group's ``pt_gloo_runloop``
threads, and the work object it frees afterwards holds a copy of the issuing thread's Python
context (``at::ThreadLocalState`` keeps the ``contextvars.Context``): freeing it takes the GIL.
Checked on torch 2.13.0 with a core file of a rank that aborted at exit (``terminate called
without an active exception``): the main thread was in ``Py_FinalizeEx`` and the gloo thread in
``~AsyncAllreduceWork`` -> ``~ThreadLocalState`` -> ``decref`` -> ``take_gil`` ->
``PyThread_exit_thread``: once the interpreter is finalizing, a thread that asks for the GIL is
made to exit, and that exit unwinds through a ``noexcept`` destructor. A rank whose last
collective finished just before the script ended (its gloo thread not yet scheduled again, as
happens on a loaded machine) could so abort after training correctly, and torchrun then failed
the whole job. pytorch issue 190489 tracks the same abort.

The fix is to let the thread finish before finalization starts: the last at-exit phase
(NOTE [at-exit order]) sleeps ``SETTLE_S`` with the GIL released when a job compiled a DDP model
over a gloo group. NCCL groups free their work without Python and are left alone; so is the
process group a user ends with ``destroy_process_group()`` (while a compiled model lives, its
DDP module holds the group, which is freed at finalization, after this phase). A script that
ends its group right after its last collective frees it there and then, while a gloo thread may
still need the GIL the main thread holds: that rank hangs. ``end_process_group()`` waits first
(the benchmarks end their groups with it).
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
