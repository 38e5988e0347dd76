"""The tiny HF Llama the CPU host probes build (a step of it is nearly all host work), and the
one gloo rank they run it on."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn


def one_cpu_rank(port: int) -> None:
    """Rank 0 of a world of one over gloo, on ``MASTER_PORT`` ``port`` unless one is set, one
    thread, a fresh Inductor cache unless one is named, no progress lines."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp())
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    os.environ.setdefault("BUCKETWISE_PROGRESS", "0")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)


def tiny_llama(layers: int, *, hidden: int) -> nn.Module:
    """An HF ``LlamaForCausalLM`` of ``layers`` layers, width ``hidden`` (MLP twice that), 2 heads
    sharing one KV head, vocabulary 64, 16 positions, no KV cache."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
        max_position_embeddings=16,
        use_cache=False,
    )
    return LlamaForCausalLM(config)
