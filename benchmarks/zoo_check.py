"""How the zoo decides that a compiled run trained like eager DDP.

The runs start from the same parameters and see the same batches, so after N steps each
tensor's **update** (final minus initial value) must match eager DDP's. A tensor passes when

    max |update_compiled - update_eager| <= RTOL[dtype] * max |update_eager| + ATOL[dtype]

Why the update and not the value: the update is what the gradients (and the averaging across
ranks) wrote, so the check is as sensitive for a weight of norm 30 as for a bias of norm 0.01.
Why these tolerances (fp32): two runs that reduce the same gradients in another order, or
through AOTAutograd's decompositions, differ by float round-off, about 1e-6 of an update;
``RTOL`` 1e-3 sits far above that and ten times below the 1% error of a single wrong gradient
(``tests/test_zoo.py`` injects one and checks it is caught). Integer buffers (BatchNorm's
``num_batches_tracked``) must be equal.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

RTOL = {torch.float32: 1e-3, torch.bfloat16: 2e-2, torch.float16: 1e-2}
"""Relative to the largest update of the tensor (see above)."""
ATOL = {torch.float32: 1e-7, torch.bfloat16: 1e-4, torch.float16: 1e-5}
"""For tensors whose update is (nearly) zero: frozen weights, experts no token picked."""


def snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, detached and copied to the CPU."""
    state = {f"param {n}": p for n, p in module.named_parameters()}
    state.update({f"buffer {n}": b for n, b in module.named_buffers()})
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


def compare(
    init: dict[str, torch.Tensor],
    eager: dict[str, torch.Tensor],
    compiled: dict[str, torch.Tensor],
    *,
    rtol_scale: float = 1.0,
) -> dict[str, Any]:
    """Worst tensor of ``compiled`` against ``eager`` (both trained from ``init``).

    Returns ``ok``, ``worst`` (the tensor with the largest error relative to its tolerance),
    ``ratio`` (its error over its tolerance: ok while <= 1) and ``rel_err`` (its error over its
    largest eager update)."""
    if eager.keys() != compiled.keys():
        missing = sorted(set(eager) ^ set(compiled))[:3]
        return {"ok": False, "worst": f"different tensors: {missing}", "ratio": float("inf"), "rel_err": None}
    worst, worst_ratio, worst_rel = None, 0.0, 0.0
    for name, start in init.items():
        e, c = eager[name], compiled[name]
        if not start.dtype.is_floating_point:
            ratio = 0.0 if torch.equal(e, c) else float("inf")
            rel = 0.0 if ratio == 0.0 else float("inf")
        else:
            ue, uc = (e - start).double(), (c - start).double()
            err = (uc - ue).abs().max().item() if ue.numel() else 0.0
            scale = ue.abs().max().item() if ue.numel() else 0.0
            tol = RTOL[start.dtype] * rtol_scale * scale + ATOL[start.dtype]
            ratio, rel = err / tol, (err / scale if scale > 0 else (0.0 if err == 0 else float("inf")))
        if worst is None or ratio > worst_ratio:
            worst, worst_ratio, worst_rel = name, ratio, rel
    return {"ok": worst_ratio <= 1.0, "worst": worst, "ratio": worst_ratio, "rel_err": worst_rel}


def replica_spread(module: nn.Module) -> float:
    """Largest difference between this rank's parameters and rank 0's (0.0: replicas equal)."""
    import torch.distributed as dist

    spread = torch.zeros((), dtype=torch.float64)
    for p in module.parameters():
        ref = p.detach().clone()
        dist.broadcast(ref, 0)
        spread = torch.maximum(spread, (p.detach() - ref).abs().max().double().cpu())
    out = spread.to(next(module.parameters()).device)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out.item()
