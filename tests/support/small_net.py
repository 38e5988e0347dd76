"""Small nets and Dynamo's graph counter: a two-layer net (test_bad_input.py, test_freeze_option.py)
and a net of three identical blocks (test_share_blocks_default.py, test_planner.py)."""

from __future__ import annotations

import torch
import torch.nn as nn


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l0 = nn.Linear(8, 16)
        self.l1 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l1(torch.tanh(self.l0(x)))


class BlocksNet(nn.Module):
    """An input layer, then three identical residual blocks: blocks bucketwise can share."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)  # so every block's input needs a gradient: the blocks are one computation
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x)
        return x.sum()
