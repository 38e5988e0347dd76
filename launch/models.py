"""Small built-in models on synthetic data (demo, tests and benchmarks; no downloads)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """A GPT-2-style decoder. Defaults are tiny; ``gpt2_small()`` gives the 124M shape."""

    vocab: int = 512
    """Vocabulary size (GPT-2 small: 50304, padded to a multiple of 64)."""
    seq: int = 64
    """Context length."""
    layers: int = 2
    d_model: int = 64
    heads: int = 4
    tie_embeddings: bool = False
    """Share the token embedding with the output head (tied weights)."""
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab", "seq", "layers", "d_model", "heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of heads ({self.heads})")

    @classmethod
    def gpt2_small(cls, **overrides) -> "GPTConfig":
        return cls(**{"vocab": 50304, "seq": 1024, "layers": 12, "d_model": 768, "heads": 12, **overrides})


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.heads = cfg.heads
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Decoder-only transformer LM; ``forward(idx, targets)`` returns the mean cross-entropy."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok.weight
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))


def synthetic_tokens(
    cfg: GPTConfig, batch: int, *, seed: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch of random tokens and next-token targets."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=g)
    return data[:, :-1].to(device), data[:, 1:].to(device)


def mlp(width: int = 256, depth: int = 4, d_in: int = 32, d_out: int = 8) -> nn.Sequential:
    """A plain ``nn.Sequential`` MLP (a torch.nn container at the top, on purpose)."""
    layers: list[nn.Module] = []
    dims = [d_in] + [width] * (depth - 1)
    for a, b in zip(dims, dims[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    layers.append(nn.Linear(dims[-1], d_out))
    return nn.Sequential(*layers)


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def flops_per_token(cfg: GPTConfig) -> float:
    """Approximate training FLOPs per token (6N + attention), for throughput reports."""
    n = 12 * cfg.layers * cfg.d_model**2 + cfg.vocab * cfg.d_model
    return 6 * n + 12 * cfg.layers * cfg.d_model * cfg.seq


__all__ = ["GPT", "GPTConfig", "Block", "synthetic_tokens", "mlp", "param_count", "flops_per_token"]
