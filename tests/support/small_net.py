"""A two-layer net and Dynamo's graph counter, shared by test_bad_input.py and test_freeze_option.py."""

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
