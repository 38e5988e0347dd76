"""A small network for the Lightning recipes: an embedding, a few residual MLP blocks, a head."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn


@dataclasses.dataclass(frozen=True)
class NetConfig:
    vocab: int = 64
    width: int = 64
    blocks: int = 3


class Net(nn.Module):
    def __init__(self, config: NetConfig = NetConfig()) -> None:
        super().__init__()
        self.embed = nn.Embedding(config.vocab, config.width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(config.width), nn.Linear(config.width, 4 * config.width), nn.GELU(),
                          nn.Linear(4 * config.width, config.width))
            for _ in range(config.blocks)
        )
        self.head = nn.Linear(config.width, config.vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def loss_of(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def batch(step: int, rank: int, vocab: int = NetConfig.vocab) -> torch.Tensor:
    return torch.randint(0, vocab, (4, 12), generator=torch.Generator().manual_seed(100 * step + rank))
