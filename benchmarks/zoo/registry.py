"""Every zoo model by name, and the named subsets (``ci``, ``gpu``)."""

from __future__ import annotations

from bucketwise.benchmarks.zoo.hf import MODELS as HF_MODELS
from bucketwise.benchmarks.zoo.spec import ZooModel
from bucketwise.benchmarks.zoo.vision import MODELS as VISION_MODELS

MODELS: dict[str, ZooModel] = {m.name: m for m in [*HF_MODELS, *VISION_MODELS]}

SUBSETS = {
    # tests/benchmarks/test_zoo.py: a decoder (with changing sequence lengths), an encoder, a mixture of
    # experts with find_unused_parameters, BatchNorm buffers, frozen weights (LoRA)
    "ci": ("llama-dynamic-seq", "bert", "qwen2-moe", "mobilenet-v3", "llama-lora"),
    # benchmarks/zoo/main.py --device cuda: the one-GPU speed and memory run, most wanted first
    "gpu": (
        "llama",
        "gpt2",
        "bert",
        "vit",
        "t5",
        "mobilenet-v3",
        "llama-lora",
        "batchnorm-cudagraphs",
        "llama-checkpointing",
        "mixtral",
        "llama-flex-attention",
        "resnet50",
        "whisper",
        "convnext",
        "timm-vit",
        "llama-max-autotune",
    ),
}


def get(name: str) -> ZooModel:
    if name not in MODELS:
        raise KeyError(f"no zoo model {name!r}; the zoo has: {', '.join(MODELS)}")
    return MODELS[name]


def select(spec: str) -> list[ZooModel]:
    """``all``, a subset name, or comma-separated model names."""
    if spec == "all":
        return list(MODELS.values())
    if spec in SUBSETS:
        return [get(n) for n in SUBSETS[spec]]
    return [get(n.strip()) for n in spec.split(",") if n.strip()]
