"""A training loop under accelerate, compiled by bucketwise (`fused`).

    accelerate launch --multi_gpu --num_processes 2 accelerate_loop.py

A tiny Llama built from its config (nothing to download) trains a few steps on synthetic tokens.
Without GPUs it runs on CPU ranks (gloo).
"""

import torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM

import bucketwise


def main():
    accelerator = Accelerator(cpu=not torch.cuda.is_available())  # the device switch: GPUs where there are
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    model = torch.compile(model, backend="bucketwise")  # compile what prepare() returned: the DDP module
    for step in range(4):
        gen = torch.Generator().manual_seed(100 * step + accelerator.process_index)  # each rank its own batch
        ids = torch.randint(0, 128, (4, 16), generator=gen).to(accelerator.device)
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.print(f"step {step}: loss {loss.item():.6f}")
    accelerator.print(bucketwise.report(model).table())
    plain = accelerator.unwrap_model(model, keep_torch_compile=False)  # the Llama, without "_orig_mod." in its keys
    accelerator.save_model(plain, "accelerate-out")  # accelerate-out/model.safetensors


if __name__ == "__main__":
    main()
