"""Private torch APIs of the fused strategy: functional collectives, Inductor's comm reordering.

Checked on torch 2.11.0 (device machines) and 2.13.0 (CI).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def group_name(pg: Any) -> str:
    """The name functional collectives use to find a process group."""
    from torch.distributed import _functional_collectives as fcol

    return str(fcol._resolve_group_name(pg))


def all_reduce_sum(flat: torch.Tensor, group: str) -> torch.Tensor:
    """Functional (traceable) all-reduce sum; Inductor lowers it to an async collective whose
    ``wait_tensor`` its comm-reordering passes may sink."""
    out = torch.ops._c10d_functional.all_reduce(flat, "sum", group)
    return torch.ops._c10d_functional.wait_tensor(out)


def world_size(pg: Any) -> int:
    return dist.get_world_size(pg)


# Inductor passes that keep collectives early and their waits late, by preference; the first
# names of each group that this torch version has are used.
_REORDER_PASSES = (
    ("reorder_communication_preserving_peak_memory", "raise_comms"),
    ("sink_waits_iterative", "sink_waits"),
)


def comm_overlap_options() -> dict[str, Any]:
    """Inductor options (applied per compile, never globally) that reorder comm and compute."""
    try:
        from torch._inductor import comms
    except ImportError:  # pragma: no cover - very old torch
        return {}
    passes = []
    for group in _REORDER_PASSES:
        for name in group:
            if hasattr(comms, name):
                passes.append(name)
                break
    if not passes:
        return {}
    return {"reorder_for_compute_comm_overlap": True, "reorder_for_compute_comm_overlap_passes": passes}
