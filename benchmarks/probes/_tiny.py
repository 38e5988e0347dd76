"""The tiny HF Llama the CPU host probes build: a step of it is nearly all host work."""

from __future__ import annotations

import torch.nn as nn


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
