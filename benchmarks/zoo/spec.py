"""What a zoo model is: how to build it, feed it and train it (shared by every zoo module).

A :class:`ZooModel` names a real architecture built from its library's config (no download),
small enough to train a few steps on CPU. Its ``build`` returns a :class:`Built`: the module,
a batch per (rank, step), and the loss of the module's output on that batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import nn

SEQ = 16
"""Tokens per sequence of the language models."""
BATCH = 2
"""Samples per rank and step."""
VOCAB = 128
IMAGE = 32
"""Side of the synthetic images (pixels)."""
CLASSES = 10


@dataclasses.dataclass(kw_only=True)
class Built:
    """A zoo model ready to train."""

    module: nn.Module
    batch: Callable[[int, int], dict[str, Any]]
    """``batch(rank, step)``: the keyword arguments of one forward call (seeded: the same on
    every run)."""
    loss: Callable[[Any, dict[str, Any]], torch.Tensor]
    """``loss(output, batch)``: a scalar to call ``backward`` on."""
    gpu_batch: Callable[[int, int], dict[str, Any]] | None = None
    """``batch`` of the one-GPU runs where it must differ (``None``: ``batch``)."""

    def batch_for(self, device: torch.device) -> Callable[[int, int], dict[str, Any]]:
        return self.gpu_batch if device.type == "cuda" and self.gpu_batch is not None else self.batch

    def __post_init__(self) -> None:
        if not isinstance(self.module, nn.Module):
            raise TypeError(f"Built.module must be an nn.Module, got {type(self.module).__name__}")
        if not callable(self.batch) or not callable(self.loss):
            raise TypeError("Built.batch and Built.loss must be callables")


@dataclasses.dataclass(kw_only=True, frozen=True)
class ZooModel:
    """One model of the zoo."""

    name: str
    family: str
    """``transformers``, ``torchvision``, ``timm``, ``peft`` or ``case`` (a pattern users report)."""
    source: str
    """What is built, as a user would write it (class and config)."""
    build: Callable[[], Built]
    needs: tuple[str, ...] = ()
    """Packages it imports (a missing one skips the model)."""
    find_unused_parameters: bool = False
    gpu_only: str | None = None
    """Why it runs on GPUs only (``None``: runs on CPU too)."""
    cpu_backend: str | None = None
    """The backend of its CPU runs where the zoo's default (``aot_eager``) would not exercise
    what the case is about (``"inductor"`` for max-autotune's tuning)."""
    min_bucket_cap_mb: float = 0.0
    """DDP's bucket cap is at least this in every config, eager DDP's included."""
    compile_kwargs: tuple[tuple[str, Any], ...] = ()
    """Extra ``bucketwise.compile`` / ``torch.compile`` keyword arguments (``mode``)."""
    accumulate: int = 1
    """Micro-batches per optimizer step (gradient accumulation: all but the last under ``no_sync()``)."""
    autocast: str | None = None
    """``torch.autocast`` dtype of the forward (``"bfloat16"``); ``None``: fp32."""

    def __post_init__(self) -> None:
        if not self.name or any(c.isspace() for c in self.name):
            raise ValueError(f"ZooModel.name must be a non-empty word, got {self.name!r}")
        families = ("transformers", "torchvision", "timm", "peft", "case")
        if self.family not in families:
            raise ValueError(f"ZooModel.family must be one of {families}, got {self.family!r}")
        if not callable(self.build):
            raise TypeError(f"ZooModel.build of {self.name} must be callable")
        if self.min_bucket_cap_mb < 0:
            raise ValueError(f"ZooModel.min_bucket_cap_mb of {self.name} must be >= 0, got {self.min_bucket_cap_mb}")
        if self.accumulate < 1:
            raise ValueError(f"ZooModel.accumulate of {self.name} must be at least 1, got {self.accumulate}")
        if self.autocast not in (None, "bfloat16", "float16"):
            raise ValueError(
                f"ZooModel.autocast of {self.name} must be None, 'bfloat16' or 'float16', got {self.autocast!r}"
            )


def tokens(rank: int, step: int, *, seq: int = SEQ, vocab: int = VOCAB, batch: int = BATCH) -> torch.Tensor:
    """Seeded token ids: rank and step pick the seed, so every run sees the same data."""
    g = torch.Generator().manual_seed(1000 * (rank + 1) + step)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def images(rank: int, step: int, *, side: int = IMAGE, channels: int = 3, batch: int = BATCH) -> torch.Tensor:
    g = torch.Generator().manual_seed(2000 * (rank + 1) + step)
    return torch.randn(batch, channels, side, side, generator=g)


def labels(rank: int, step: int, *, classes: int = CLASSES, batch: int = BATCH) -> torch.Tensor:
    g = torch.Generator().manual_seed(3000 * (rank + 1) + step)
    return torch.randint(0, classes, (batch,), generator=g)


def hf_loss(output: Any, batch: dict[str, Any]) -> torch.Tensor:
    """Hugging Face models compute their loss from ``labels`` inside the forward."""
    return output.loss


def logits_loss(output: Any, batch: dict[str, Any]) -> torch.Tensor:
    """Cross entropy of image-classifier logits against ``batch["_labels"]``."""
    logits = output.logits if hasattr(output, "logits") else output
    return nn.functional.cross_entropy(logits.float(), batch["_labels"])


def forward_kwargs(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch without the keys the loss reads (``_labels``)."""
    return {k: v for k, v in batch.items() if not k.startswith("_")}


DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def no_dropout(module: nn.Module) -> nn.Module:
    """Dropout and stochastic depth off (their random masks differ between eager and
    compiled runs), BatchNorm and everything else left as it is."""
    for m in module.modules():
        if isinstance(m, DROPOUTS):
            m.p = 0.0
        for attr in ("drop_prob", "stochastic_depth_prob"):
            if isinstance(getattr(m, attr, None), float):
                setattr(m, attr, 0.0)
        if type(m).__name__ == "StochasticDepth":
            m.p = 0.0
    return module
