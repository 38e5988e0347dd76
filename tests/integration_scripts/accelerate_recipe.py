"""accelerate with bucketwise (docs/integrations-recipes.md), next to the same eager loop.

Run by tests/test_integration_accelerate.py as ``accelerate launch --multi_gpu --num_processes 2
accelerate_recipe.py`` on a CPU host (``Accelerator(cpu=True)``: gloo): a tiny Llama built from its
config trains a few steps on synthetic tokens, eagerly and compiled after ``prepare``.
"""

from __future__ import annotations

import torch
from _recipe_io import INNER, save
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM

STEPS = 4


def train(accelerator: Accelerator, compiled: bool) -> tuple[torch.nn.Module, list[float]]:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    if compiled:
        # The recipe: compile what prepare() returned (the DDP module).
        model = torch.compile(model, backend="bucketwise", options=INNER)
    losses = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 * step + accelerator.process_index)
        ids = torch.randint(0, 128, (4, 16), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return accelerator.unwrap_model(model, keep_torch_compile=False), losses


def main() -> None:
    accelerator = Accelerator(cpu=True)
    assert accelerator.num_processes == 2, accelerator.state
    for run in ("eager", "bucketwise"):
        model, losses = train(accelerator, run == "bucketwise")
        save(run, accelerator.process_index, model.named_parameters(), losses)


if __name__ == "__main__":
    main()
