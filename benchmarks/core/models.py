"""Benchmark models on synthetic data: ``gpt``, ``gpt-medium``, ``gpt-tiny``, ``llama``, ``convnet``, ``mlp``.

Each model is a :class:`ModelSpec`: default sizes, which size flags apply, how to build the
module, a fixed synthetic batch per rank and the loss of one forward. The size flags are shared
by all models (``--layers --d-model --heads --seq --batch --vocab``); their meaning per model is
in ``SIZE_MEANING`` and a flag that does not apply to the chosen model is an error.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from bucketwise.launch.models import GPT, GPTConfig, mlp, param_count, synthetic_tokens

SIZE_FLAGS = ("layers", "d_model", "heads", "seq", "batch", "vocab")

SIZE_MEANING = {
    "gpt": {
        "layers": "transformer blocks",
        "d_model": "model width",
        "heads": "attention heads",
        "seq": "context length",
        "batch": "sequences per rank",
        "vocab": "vocabulary size",
    },
    "convnet": {
        "layers": "residual blocks per stage (3 stages)",
        "d_model": "width of the first stage",
        "seq": "image side in pixels",
        "batch": "images per rank",
        "vocab": "classes",
    },
    "mlp": {
        "layers": "linear layers (depth)",
        "d_model": "hidden width",
        "batch": "samples per rank",
        "vocab": "output classes",
    },
}
SIZE_MEANING["gpt-tiny"] = SIZE_MEANING["gpt-medium"] = SIZE_MEANING["llama"] = SIZE_MEANING["gpt"]

DEFAULT_SIZES = {
    # GPT-2 small (124M shape, untied head): GPTConfig.gpt2_small().
    "gpt": {"layers": 12, "d_model": 768, "heads": 12, "seq": 1024, "batch": 8, "vocab": 50304},
    # GPT-2 medium's shape (24 layers, d 1024, 16 heads; about 406M parameters with the untied
    # head), batch 4 x 1024: twice gpt's gradient bytes per step.
    "gpt-medium": {"layers": 24, "d_model": 1024, "heads": 16, "seq": 1024, "batch": 4, "vocab": 50304},
    # A small GPT with the real GPT-2 vocabulary: head/embedding dominate the gradient bytes.
    "gpt-tiny": {"layers": 6, "d_model": 256, "heads": 4, "seq": 128, "batch": 4, "vocab": 50304},
    # Hugging Face transformers' LlamaForCausalLM built from a config (no download): 8 layers,
    # d 1024, 16 heads, SwiGLU 2816, Llama-2's 32000-token vocabulary, batch 4 x 1024.
    "llama": {"layers": 8, "d_model": 1024, "heads": 16, "seq": 1024, "batch": 4, "vocab": 32000},
    # ResNet-18-like for 32x32 images (CIFAR shape): 3 stages of 2 basic blocks, BatchNorm.
    "convnet": {"layers": 2, "d_model": 64, "seq": 32, "batch": 64, "vocab": 10},
    # bucketwise.launch.models.mlp defaults (a top-level nn.Sequential), 32 inputs.
    "mlp": {"layers": 4, "d_model": 256, "batch": 32, "vocab": 8},
}
MLP_INPUTS = 32


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ConvNet(nn.Module):
    """A small ResNet: 3x3 stem, three stages (width w, 2w, 4w; stride 1, 2, 2), avgpool, fc."""

    def __init__(self, *, width: int, blocks: int, classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        stages, c_in = [], width
        for i, c_out in enumerate((width, 2 * width, 4 * width)):
            for j in range(blocks):
                stages.append(BasicBlock(c_in, c_out, 2 if i > 0 and j == 0 else 1))
                c_in = c_out
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(c_in, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stages(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(y, 1), 1))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    name: str
    sizes: dict[str, int]
    build: Callable[[], nn.Module]
    make_batch: Callable[[int, torch.device], tuple[torch.Tensor, ...]]
    """``(seed, device) -> batch``: one fixed synthetic batch, reused every step."""
    loss: Callable[[nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]
    items_per_batch: int
    """Tokens (gpt) or samples (convnet, mlp) in one rank's batch."""
    unit: str
    """``tokens`` or ``samples``."""
    bf16_autocast: bool
    """Use bf16 autocast for the forward on CUDA."""

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        if self.bf16_autocast and device.type == "cuda":
            return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def describe(self) -> dict[str, Any]:
        with torch.device("meta"):
            params = param_count(self.build())
        return {
            "model": self.name,
            **self.sizes,
            "params": params,
            "items_per_rank_step": self.items_per_batch,
            "unit": self.unit,
            "bf16_autocast_on_cuda": self.bf16_autocast,
            "size_meaning": SIZE_MEANING[self.name],
        }


def _classifier_loss(module: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(module(x).float(), y)


def _random_batch(shape: tuple[int, ...], classes: int, batch: int):
    def make(seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn((batch, *shape), generator=g)
        y = torch.randint(0, classes, (batch,), generator=g)
        return x.to(device), y.to(device)

    return make


def _gpt_spec(name: str, s: dict[str, int]) -> ModelSpec:
    cfg = GPTConfig(vocab=s["vocab"], seq=s["seq"], layers=s["layers"], d_model=s["d_model"], heads=s["heads"])
    return ModelSpec(
        name=name,
        sizes=s,
        build=lambda: GPT(cfg),
        make_batch=lambda seed, device: synthetic_tokens(cfg, s["batch"], seed=seed, device=device),
        loss=lambda module, batch: module(*batch),
        items_per_batch=s["batch"] * s["seq"],
        unit="tokens",
        bf16_autocast=True,
    )


def _llama_spec(s: dict[str, int]) -> ModelSpec:
    """``transformers.LlamaForCausalLM`` from a ``LlamaConfig`` (needs ``transformers``)."""

    def build() -> nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=s["vocab"],
            hidden_size=s["d_model"],
            intermediate_size=s["d_model"] * 11 // 4,
            num_hidden_layers=s["layers"],
            num_attention_heads=s["heads"],
            max_position_embeddings=s["seq"],
            attn_implementation="sdpa",
            use_cache=False,  # training: no key/value cache built in the forward
        )
        return LlamaForCausalLM(cfg)

    def loss(module: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        tokens, targets = batch
        logits = module(input_ids=tokens).logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def make_batch(seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        data = torch.randint(0, s["vocab"], (s["batch"], s["seq"] + 1), generator=g)
        return data[:, :-1].to(device), data[:, 1:].to(device)

    return ModelSpec(
        name="llama",
        sizes=s,
        build=build,
        make_batch=make_batch,
        loss=loss,
        items_per_batch=s["batch"] * s["seq"],
        unit="tokens",
        bf16_autocast=True,
    )


def _convnet_spec(s: dict[str, int]) -> ModelSpec:
    return ModelSpec(
        name="convnet",
        sizes=s,
        build=lambda: ConvNet(width=s["d_model"], blocks=s["layers"], classes=s["vocab"]),
        make_batch=_random_batch((3, s["seq"], s["seq"]), s["vocab"], s["batch"]),
        loss=_classifier_loss,
        items_per_batch=s["batch"],
        unit="samples",
        bf16_autocast=False,
    )


def _mlp_spec(s: dict[str, int]) -> ModelSpec:
    return ModelSpec(
        name="mlp",
        sizes=s,
        build=lambda: mlp(width=s["d_model"], depth=s["layers"], d_in=MLP_INPUTS, d_out=s["vocab"]),
        make_batch=_random_batch((MLP_INPUTS,), s["vocab"], s["batch"]),
        loss=_classifier_loss,
        items_per_batch=s["batch"],
        unit="samples",
        bf16_autocast=False,
    )


MODELS = tuple(DEFAULT_SIZES)


def check_overrides(model: str, overrides: dict[str, int | None]) -> None:
    """Raise ``ValueError`` for an unknown model or a size flag that does not apply to it."""
    if model not in DEFAULT_SIZES:
        raise ValueError(f"unknown model {model!r}; known models: {', '.join(MODELS)}")
    for key, value in overrides.items():
        if value is None:
            continue
        if key not in DEFAULT_SIZES[model]:
            applies = ", ".join("--" + k.replace("_", "-") for k in DEFAULT_SIZES[model])
            raise ValueError(f"--{key.replace('_', '-')} does not apply to model {model!r} (it takes {applies})")
        if value <= 0:
            raise ValueError(f"--{key.replace('_', '-')} must be positive, got {value}")


def make_spec(model: str, overrides: dict[str, int | None]) -> ModelSpec:
    check_overrides(model, overrides)
    sizes = {**DEFAULT_SIZES[model], **{k: v for k, v in overrides.items() if v is not None}}
    if model in ("gpt", "gpt-medium", "gpt-tiny"):
        if sizes["d_model"] % sizes["heads"]:
            raise ValueError(f"--d-model ({sizes['d_model']}) must be a multiple of --heads ({sizes['heads']})")
        return _gpt_spec(model, sizes)
    if model == "llama":
        return _llama_spec(sizes)
    if model == "convnet":
        return _convnet_spec(sizes)
    return _mlp_spec(sizes)
