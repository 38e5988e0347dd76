"""How the zoo decides that a compiled run trained like eager DDP.

The runs start from the same parameters and see the same batches, so after N steps each
tensor's **update** (final minus initial value) must match eager DDP's. A tensor passes when

    max |update_compiled - update_eager| <= RTOL[dtype] * max |update_eager| + ATOL[dtype]

Why the update and not the value: the update is what the gradients (and the averaging across
ranks) wrote, so the check is as sensitive for a weight of norm 30 as for a bias of norm 0.01.
Why these tolerances (fp32): two runs that reduce the same gradients in another order, or
through AOTAutograd's decompositions, differ by float round-off, about 1e-6 of an update;
``RTOL`` 1e-3 sits far above that and ten times below the 1% error of a single wrong gradient
(``tests/benchmarks/test_zoo.py`` injects one and checks it is caught). Integer buffers (BatchNorm's
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


FP64_MULTIPLIER = 3.0
"""``against_fp64``: how much farther from the float64 update than eager's own a config's may be."""
FP64_FLOOR = 1e-3
"""``against_fp64``: errors below this fraction of the largest float64 update always pass."""


def against_fp64(
    init: dict[str, torch.Tensor],
    eager: dict[str, torch.Tensor],
    compiled: dict[str, torch.Tensor],
    exact: dict[str, torch.Tensor],
) -> dict[str, Any]:
    """``compiled``'s update against the update of a float64 copy of the model (``exact``), with
    eager's own distance from it as the yardstick: a tensor passes when

        rms(update_compiled - update_fp64) <= FP64_MULTIPLIER * rms(update_eager - update_fp64)
                                              + FP64_FLOOR * max |update_fp64|

    Where round-off alone is as large as an update (BatchNorm over few values), eager's fp32 run
    is as far from the float64 one as a correct compiled run; a wrong gradient is far beyond
    both. Integer buffers must be equal. Same fields as :func:`compare`."""
    worst, worst_ratio, worst_rel = None, 0.0, 0.0
    for name, start in init.items():
        e, c, x = eager[name], compiled[name], exact[name]
        if not start.dtype.is_floating_point:
            ratio = 0.0 if torch.equal(e, c) else float("inf")
            rel = ratio
        else:
            ux = (x.double() - start.double()).flatten()
            ue, uc = (e.double() - start.double()).flatten(), (c.double() - start.double()).flatten()
            err_c = (uc - ux).pow(2).mean().sqrt().item() if ux.numel() else 0.0
            err_e = (ue - ux).pow(2).mean().sqrt().item() if ux.numel() else 0.0
            scale = ux.abs().max().item() if ux.numel() else 0.0
            tol = FP64_MULTIPLIER * err_e + FP64_FLOOR * scale + ATOL[start.dtype]
            ratio, rel = err_c / tol, (err_c / scale if scale > 0 else 0.0)
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
