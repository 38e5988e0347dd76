"""What a recipe script hands back to its test: per run and rank, the final parameters and the
losses, in ``<out>/<run>-rank<R>.pt``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import torch

OUT_ENV = "BUCKETWISE_RECIPE_OUT"
INNER = {"inner_backend": "aot_eager"}
"""Tests compile with AOTAutograd and no code generation (the same kernels as eager): fast, exact."""


def save(run: str, rank: int, named_params: Iterable[tuple[str, torch.Tensor]], losses: list[float]) -> None:
    out = Path(os.environ[OUT_ENV])
    params = {name: p.detach().cpu().clone() for name, p in named_params}
    torch.save({"params": params, "losses": [float(x) for x in losses]}, out / f"{run}-rank{rank}.pt")
