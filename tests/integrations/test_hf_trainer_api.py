"""``bucketwise.hf``: argument checks, and the one-process path (no DDP module: the model the
Trainer trains is compiled with the inner backend alone) against the plain Trainer, in this
process. The 2-rank ``fused`` path: tests/docs/test_doc_recipes.py (the docs' HF Trainer recipe)."""

from __future__ import annotations

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

import bucketwise  # noqa: E402
from bucketwise.hf import BucketwiseTrainer, check_options, with_bucketwise  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )


def _args(tmp_path, **kwargs) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        max_steps=3,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        **kwargs,
    )


def test_options_checked_like_bucketwise_compile():
    assert check_options(None) == {}
    assert check_options({"backend": "aot_eager", "strategy": "split"}) == {"backend": "aot_eager", "strategy": "split"}
    with pytest.raises(
        ValueError, match=r"bucketwise_options: unknown key\(s\) \['stratgy'\]; accepted: \[.*'strategy'"
    ):
        check_options({"stratgy": "split"})
    with pytest.raises(ValueError, match="unknown strategy 'fast'"):
        check_options({"strategy": "fast"})
    with pytest.raises(TypeError, match="bucketwise_options must be a dict"):
        check_options("aot_eager")


def test_refuses_a_compiled_model_and_torch_compile(tmp_path):
    with pytest.raises(ValueError, match=r"^model: BucketwiseTrainer compiles the model itself"):
        BucketwiseTrainer(model=torch.compile(_model()), args=_args(tmp_path), train_dataset=Tokens())
    with pytest.raises(ValueError, match=r"^args.torch_compile=True: .*leave torch_compile off"):
        BucketwiseTrainer(model=_model(), args=_args(tmp_path, torch_compile=True), train_dataset=Tokens())


def test_with_bucketwise_makes_a_subclass():
    class MyTrainer(Trainer):
        pass

    cls = with_bucketwise(MyTrainer)
    assert cls.__name__ == "BucketwiseMyTrainer" and issubclass(cls, MyTrainer)
    assert cls.compute_loss is BucketwiseTrainer.compute_loss
    with pytest.raises(TypeError, match="trainer_class must be transformers.Trainer or a subclass"):
        with_bucketwise(torch.nn.Module)


def test_one_process_compiles_the_model_and_trains_like_the_trainer(tmp_path, caplog):
    eager = Trainer(model=_model(), args=_args(tmp_path / "eager"), train_dataset=Tokens())
    eager.train()
    with caplog.at_level(logging.INFO, logger="bucketwise.hf"):
        trainer = BucketwiseTrainer(
            model=_model(),
            args=_args(tmp_path / "bw"),
            train_dataset=Tokens(),
            bucketwise_options={"backend": "aot_eager"},
        )
        trainer.train()
    assert "one process, no DDP module: LlamaForCausalLM compiled with backend 'aot_eager' alone" in caplog.text
    rep = trainer.bucketwise_report()
    assert rep.graphs and rep.graph_runs >= 3 and rep.totals["eager_calls"] == 0, rep
    assert rep is bucketwise.report(trainer._bucketwise_plain[1])
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (eager, trainer)]
    assert len(losses[0]) == 3
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for (name, p), (_, q) in zip(eager.model.named_parameters(), trainer.model.named_parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
