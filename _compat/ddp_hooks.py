"""The comm hooks registered on a DDP module, and torch's PowerSGD internals the fused graphs
reproduce (``distributed/fused/hook_kinds.py``, ``powersgd.py``). Checked on torch 2.13.0 (CI);
tests/gpu/test_gpu_powersgd.py and test_gpu_comm_hooks.py run them on 2.11.0."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def comm_hook(ddp: DDP) -> tuple[Any, Any] | None:
    """The Python comm hook registered last and its state, ``(hook, state)``, or ``None``."""
    hooks = getattr(ddp, "_comm_hooks", None) or []
    return hooks[-1] if hooks else None


def comm_hook_count(ddp: DDP) -> int:
    """Python comm hooks on ``ddp``, read per call (one registered later changes the graphs); a
    built-in hook goes to the reducer, which a released reducer rebuilds for it."""
    return len(getattr(ddp, "_comm_hooks", None) or ())


def builtin_hook_name(ddp: DDP) -> str | None:
    """A C++ comm hook registered with ``_register_builtin_comm_hook`` (not in ``_comm_hooks``):
    only DDP's logging data names it. Not read from a released reducer's stand-in, which would
    rebuild it: the reducer is released only after the hook check passed."""
    if not isinstance(getattr(ddp, "logger", None), dist.Logger):
        return None
    return ddp._get_ddp_logging_data().get("comm_hook") or None


def batched_powersgd_works() -> bool:
    """Whether torch's ``batched_powerSGD_hook`` can run past ``start_powerSGD_iter``: it hands
    ``_orthogonalize`` a 2-D matrix, which takes only 3-D batches since torch 1.12 (pytorch
    pull request 75157; seen failing on 2.13.0)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

    try:
        ps._orthogonalize(torch.ones(2, 1))
    except Exception:  # noqa: BLE001 - any failure means the hook fails the same way
        return False
    return True


def powersgd_gram_schmidt_(matrices: torch.Tensor, epsilon: float) -> None:
    """torch's ``powerSGD_hook._orthogonalize_gram_schmidt``, in place and traceable."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

    ps._orthogonalize_gram_schmidt(matrices, epsilon=epsilon)
