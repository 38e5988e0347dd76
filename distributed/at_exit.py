"""bucketwise's one interpreter-exit handler: its parts run in a fixed order.

NOTE [at-exit order]: at interpreter exit, in this order: (1) ``profile``: an open profile started
from the environment stops and hands its view to the job's stats; (2) ``reports``: reports write
their pending rank files; (3) ``job stats``: ranks publish their last entry and rank 0 gathers
every rank's files (NOTE [job-wide stats]); (4) ``cuda graphs``: CUDA graphs holding NCCL kernels
are released (NOTE [cuda graphs at teardown]) before torch tears the communicators down;
(5) ``gloo threads``: a short wait, GIL released, for gloo's threads (NOTE [gloo at exit]).
``atexit`` runs handlers last-registered first, and each part would register when the script
first needs it, so only this module registers, once. A failing part is logged; the next still runs.
"""

from __future__ import annotations

import atexit
import logging
from typing import Callable

log = logging.getLogger(__name__)

PHASES = ("profile", "reports", "job stats", "cuda graphs", "gloo threads")

_parts: dict[str, list[Callable[[], None]]] = {phase: [] for phase in PHASES}
_registered = False


def at_exit(phase: str, fn: Callable[[], None]) -> None:
    """Run ``fn`` at interpreter exit, in ``phase`` (one of :data:`PHASES`); once per ``fn``."""
    global _registered
    if phase not in _parts:
        raise AssertionError(f"expected an at-exit phase of {PHASES}, got {phase!r}")
    if fn not in _parts[phase]:
        _parts[phase].append(fn)
    if not _registered:
        atexit.register(run_all)
        _registered = True


def run_all() -> None:
    """Every part, phase by phase (what the interpreter's exit runs)."""
    for phase in PHASES:
        for fn in list(_parts[phase]):
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - at exit: say it, never mask the job's own end
                log.warning("bucketwise: at exit (%s): %s: %s", phase, type(exc).__name__, exc)
