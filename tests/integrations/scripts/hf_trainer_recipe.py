"""HF Trainer given ``model=torch.compile(model, backend="bucketwise")`` (docs/integrations-recipes.md,
the way without ``BucketwiseTrainer``: DDP wraps the compiled model, ``split``), next to the same
eager Trainer.

Run by tests/integrations/test_integration_hf_trainer.py as
``torchrun --standalone --nproc_per_node 2 hf_trainer_recipe.py`` (gloo on CPU): a tiny Llama
built from its config (nothing downloaded) trains a few steps on synthetic tokens, eagerly and
then compiled that way.
"""

from __future__ import annotations

import os
import time

import torch
from _recipe_io import INNER, save
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

STEPS = 4


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


def train(compiled: bool) -> Trainer:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config)
    extra = {}
    if compiled:
        # The recipe: compile the model yourself, leave torch_compile off, keep every column, and
        # tell DDP every parameter is used (its buckets then follow the order of use).
        model = torch.compile(model, backend="bucketwise", options=INNER)
        extra.update(remove_unused_columns=False, ddp_find_unused_parameters=False)
    args = TrainingArguments(
        output_dir=os.path.join(os.environ["BUCKETWISE_RECIPE_OUT"], "trainer"),
        per_device_train_batch_size=4,
        max_steps=STEPS,
        learning_rate=1e-2,
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        seed=0,
        data_seed=0,
        disable_tqdm=True,
        **extra,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    trainer.train()
    return trainer


def main() -> None:
    rank = int(os.environ["RANK"])
    for run in ("eager", "bucketwise"):
        trainer = train(run == "bucketwise")
        if run == "bucketwise":
            import bucketwise

            # report() accepts what torch.compile returned
            assert [g.strategy for g in bucketwise.report(trainer.model).graphs] == ["split"]
        model = getattr(trainer.model, "_orig_mod", trainer.model)
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        save(run, rank, model.named_parameters(), losses)
    time.sleep(1)  # gloo's threads may still be freeing the last collective's tensors: docs/troubleshooting.md
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
