"""The HF Trainer on bucketwise's `fused` strategy.

    torchrun --nproc-per-node 2 hf_trainer.py

A tiny Llama built from its config (nothing to download) trains a few steps on synthetic tokens.
Without GPUs it runs on CPU ranks (gloo).
"""

import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

import bucketwise
from bucketwise.hf import BucketwiseTrainer


class Tokens(torch.utils.data.Dataset):
    """Synthetic token sequences: use your own dataset."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def main():
    cpu = not torch.cuda.is_available()  # the device switch: GPUs where there are, else CPU ranks
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
    args = TrainingArguments(
        output_dir="hf-out",
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=4,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=cpu,
    )
    trainer = BucketwiseTrainer(model=model, args=args, train_dataset=Tokens())  # instead of Trainer(...)
    trainer.train()
    trainer.save_model()  # hf-out/model.safetensors
    trainer.save_state()  # hf-out/trainer_state.json: the losses
    if trainer.is_world_process_zero():
        print(bucketwise.report(trainer.model).table())
    if cpu:  # gloo's threads may still be freeing the last collective's tensors: docs/troubleshooting.md
        time.sleep(1)
    trainer.accelerator.end_training()  # ends the process group


if __name__ == "__main__":
    main()
