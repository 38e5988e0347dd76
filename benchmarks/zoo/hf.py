"""The zoo's Hugging Face transformers (and peft) models, built from their configs.

Every model is tiny (hidden size 32, 4 heads, 1-2 layers, vocabulary ``VOCAB``) and dropout-free;
the architecture (attention, normalisation, position encoding, heads) is the library's own.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from bucketwise.benchmarks.zoo.spec import (
    BATCH,
    CLASSES,
    IMAGE,
    SEQ,
    VOCAB,
    Built,
    ZooModel,
    hf_loss,
    images,
    labels,
    no_dropout,
    tokens,
)

DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    attention_dropout=0.0,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
"""Shared by the decoder-only language models (Llama-like)."""
ENCODER = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)
"""Shared by the BERT-like encoders."""


def _transformers() -> Any:
    import transformers

    return transformers


def causal_lm(
    config_cls: str,
    model_cls: str,
    *,
    seqs: tuple[int, ...] = (SEQ,),
    uneven: bool = False,
    setup: Callable | None = None,
    **overrides: Any,
) -> Callable[[], Built]:
    """A decoder-only LM trained on next-token loss; ``seqs[step % len(seqs)]`` tokens a step
    (``uneven``: ``seqs[(step + rank) % len(seqs)]``, so the ranks' lengths differ)."""

    def build() -> Built:
        tf = _transformers()
        config = getattr(tf, config_cls)(**{**DECODER, **overrides})
        module = no_dropout(getattr(tf, model_cls)(config))
        if setup is not None:
            module = setup(module)

        def batch(rank: int, step: int) -> dict[str, Any]:
            ids = tokens(rank, step, seq=seqs[(step + (rank if uneven else 0)) % len(seqs)])
            return {"input_ids": ids, "labels": ids}

        return Built(module=module, batch=batch, loss=hf_loss)

    return build


def masked_lm(config_cls: str, model_cls: str, **overrides: Any) -> Callable[[], Built]:
    """An encoder trained on a masked-LM loss over every token."""

    def build() -> Built:
        tf = _transformers()
        module = no_dropout(getattr(tf, model_cls)(getattr(tf, config_cls)(**{**ENCODER, **overrides})))

        def batch(rank: int, step: int) -> dict[str, Any]:
            ids = tokens(rank, step, vocab=VOCAB - 4) + 4  # keep clear of the special ids
            return {"input_ids": ids, "labels": ids}

        return Built(module=module, batch=batch, loss=hf_loss)

    return build


def seq2seq(config_cls: str, model_cls: str, **config: Any) -> Callable[[], Built]:
    """An encoder-decoder trained on teacher-forced labels."""

    def build() -> Built:
        tf = _transformers()
        module = no_dropout(getattr(tf, model_cls)(getattr(tf, config_cls)(**config)))

        def batch(rank: int, step: int) -> dict[str, Any]:
            src = tokens(rank, step, vocab=VOCAB - 4) + 4
            tgt = tokens(rank, step + 100, seq=SEQ // 2, vocab=VOCAB - 4) + 4
            return {"input_ids": src, "labels": tgt}

        return Built(module=module, batch=batch, loss=hf_loss)

    return build


def vit() -> Built:
    tf = _transformers()
    config = tf.ViTConfig(
        image_size=IMAGE,
        patch_size=8,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        num_labels=CLASSES,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    module = no_dropout(tf.ViTForImageClassification(config))
    return Built(module=module, batch=lambda r, s: {"pixel_values": images(r, s), "labels": labels(r, s)}, loss=hf_loss)


def clip() -> Built:
    tf = _transformers()
    text = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        attention_dropout=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    vision = dict(
        image_size=IMAGE,
        patch_size=8,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        attention_dropout=0.0,
    )
    module = no_dropout(tf.CLIPModel(tf.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)))
    return Built(
        module=module,
        loss=hf_loss,
        batch=lambda r, s: {"input_ids": tokens(r, s), "pixel_values": images(r, s), "return_loss": True},
    )


def whisper() -> Built:
    tf = _transformers()
    config = tf.WhisperConfig(
        vocab_size=VOCAB,
        num_mel_bins=16,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_source_positions=16,
        max_target_positions=32,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
        suppress_tokens=None,
        begin_suppress_tokens=None,
    )
    module = no_dropout(tf.WhisperForConditionalGeneration(config))

    def batch(rank: int, step: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(4000 * (rank + 1) + step)
        features = torch.randn(BATCH, 16, 32, generator=g)  # 2 x max_source_positions frames
        return {"input_features": features, "labels": tokens(rank, step, seq=8, vocab=VOCAB - 4) + 4}

    return Built(module=module, batch=batch, loss=hf_loss)


def lora_llama() -> Built:
    import peft

    built = causal_lm("LlamaConfig", "LlamaForCausalLM")()
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    built.module = peft.get_peft_model(built.module, lora)
    return built


def checkpointed(module: Any) -> Any:
    module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return module


def checkpointed_reentrant(module: Any) -> Any:
    module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    return module


T5 = dict(
    vocab_size=VOCAB,
    d_model=32,
    d_kv=8,
    d_ff=64,
    num_layers=2,
    num_heads=4,
    dropout_rate=0.0,
    decoder_start_token_id=0,
    pad_token_id=0,
    eos_token_id=1,
)
BART = dict(
    vocab_size=VOCAB,
    d_model=32,
    encoder_layers=1,
    decoder_layers=1,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    max_position_embeddings=64,
    dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
)
MOE = dict(num_local_experts=4, num_experts_per_tok=2)
QWEN_MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    decoder_sparse_step=1,
)

TF = ("transformers",)


def _hf(name: str, source: str, build: Callable[[], Built], **kw: Any) -> ZooModel:
    return ZooModel(name=name, family="transformers", source=source, build=build, needs=TF, **kw)


MODELS = [
    _hf("llama", "LlamaForCausalLM", causal_lm("LlamaConfig", "LlamaForCausalLM")),
    _hf("mistral", "MistralForCausalLM", causal_lm("MistralConfig", "MistralForCausalLM", sliding_window=8)),
    _hf("qwen2", "Qwen2ForCausalLM", causal_lm("Qwen2Config", "Qwen2ForCausalLM")),
    _hf("qwen3", "Qwen3ForCausalLM", causal_lm("Qwen3Config", "Qwen3ForCausalLM", head_dim=8)),
    _hf("gemma", "GemmaForCausalLM", causal_lm("GemmaConfig", "GemmaForCausalLM", head_dim=8)),
    _hf("phi3", "Phi3ForCausalLM", causal_lm("Phi3Config", "Phi3ForCausalLM", resid_pdrop=0.0, embd_pdrop=0.0)),
    _hf(
        "gpt2",
        "GPT2LMHeadModel",
        causal_lm(
            "GPT2Config",
            "GPT2LMHeadModel",
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        ),
    ),
    _hf("gpt-neox", "GPTNeoXForCausalLM", causal_lm("GPTNeoXConfig", "GPTNeoXForCausalLM", hidden_dropout=0.0)),
    _hf("bert", "BertForMaskedLM", masked_lm("BertConfig", "BertForMaskedLM")),
    _hf("roberta", "RobertaForMaskedLM", masked_lm("RobertaConfig", "RobertaForMaskedLM", pad_token_id=1)),
    _hf("deberta-v2", "DebertaV2ForMaskedLM", masked_lm("DebertaV2Config", "DebertaV2ForMaskedLM")),
    _hf("t5", "T5ForConditionalGeneration", seq2seq("T5Config", "T5ForConditionalGeneration", **T5)),
    _hf("bart", "BartForConditionalGeneration", seq2seq("BartConfig", "BartForConditionalGeneration", **BART)),
    _hf("vit", "ViTForImageClassification", vit),
    _hf("clip", "CLIPModel (contrastive loss)", clip),
    _hf("whisper", "WhisperForConditionalGeneration", whisper),
    _hf("mixtral", "MixtralForCausalLM (4 experts, top 2)", causal_lm("MixtralConfig", "MixtralForCausalLM", **MOE)),
    _hf(
        "qwen2-moe",
        "Qwen2MoeForCausalLM (4 experts, top 2, shared expert), find_unused_parameters=True",
        causal_lm("Qwen2MoeConfig", "Qwen2MoeForCausalLM", **QWEN_MOE),
        find_unused_parameters=True,
    ),
    ZooModel(
        name="llama-lora",
        family="peft",
        source="peft LoRA (r 4, q_proj and v_proj) on LlamaForCausalLM",
        build=lora_llama,
        needs=("transformers", "peft"),
    ),
    ZooModel(
        name="llama-checkpointing",
        family="case",
        source="LlamaForCausalLM, gradient_checkpointing_enable (use_reentrant=False)",
        build=causal_lm("LlamaConfig", "LlamaForCausalLM", setup=checkpointed),
        needs=TF,
    ),
    ZooModel(
        name="llama-dynamic-seq",
        family="case",
        source="LlamaForCausalLM, sequence length 16, 24, 32 in turn",
        build=causal_lm("LlamaConfig", "LlamaForCausalLM", seqs=(16, 24, 32)),
        needs=TF,
    ),
    ZooModel(
        name="llama-uneven-seq",
        family="case",
        source="LlamaForCausalLM, sequence lengths 16, 24, 32 in turn, another one on each rank",
        build=causal_lm("LlamaConfig", "LlamaForCausalLM", seqs=(16, 24, 32), uneven=True),
        needs=TF,
    ),
    ZooModel(
        name="llama-checkpointing-reentrant",
        family="case",
        source="LlamaForCausalLM, gradient_checkpointing_enable (use_reentrant=True)",
        build=causal_lm("LlamaConfig", "LlamaForCausalLM", setup=checkpointed_reentrant),
        needs=TF,
    ),
    ZooModel(
        name="llama-accumulation",
        family="case",
        source="LlamaForCausalLM, 2 micro-batches a step, the first under no_sync()",
        build=causal_lm("LlamaConfig", "LlamaForCausalLM"),
        needs=TF,
        accumulate=2,
    ),
    ZooModel(
        name="llama-bf16-autocast",
        family="case",
        source="LlamaForCausalLM, forward under torch.autocast(bfloat16)",
        build=causal_lm("LlamaConfig", "LlamaForCausalLM"),
        needs=TF,
        autocast="bfloat16",
    ),
    ZooModel(
        name="llama-flex-attention",
        family="case",
        source="LlamaForCausalLM (hidden 256, 2 layers), attn_implementation='flex_attention', DDP bucket cap 1 MiB",
        build=causal_lm(
            "LlamaConfig",
            "LlamaForCausalLM",
            attn_implementation="flex_attention",
            hidden_size=256,
            intermediate_size=512,
        ),
        needs=TF,
        gpu_only="FlexAttention has no backward on CPU (NotImplementedError in torch 2.13)",
        # transformers builds the block mask with torch.compile inside the forward: under eager
        # DDP that compile runs torch's DDPOptimizer, which needs a cap of at least its 1 MiB
        # first bucket; the wider model still fills several buckets of that size.
        min_bucket_cap_mb=1.0,
    ),
    ZooModel(
        name="llama-max-autotune",
        family="case",
        source="LlamaForCausalLM, mode='max-autotune'",
        build=causal_lm("LlamaConfig", "LlamaForCausalLM"),
        needs=TF,
        compile_kwargs=(("mode", "max-autotune"),),
        cpu_backend="inductor",
    ),
]
