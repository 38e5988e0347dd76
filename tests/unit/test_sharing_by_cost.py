"""``share_blocks="auto"`` without CUDA graphs decides from a block's graphs (NOTE [sharing by
cost]): the estimate is a function of the block's forward and backward and the device's constants,
so every rank and restart decides alike, and the cases measured on one H200 decide as measured
there: an HF Llama block (d 1024, 16 heads, 1024 tokens, bf16) at batch 4 was bound by the host
(kept whole), at batch 12 by the GPU (shared). The graphs are traced on the meta device, as
Dynamo and AOTAutograd hand them to bucketwise, without running anything."""

from __future__ import annotations

import pytest
import torch

from bucketwise._compat import aot
from bucketwise.compiler.blocks import find


def _llama_block_graphs(batch: int) -> tuple:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=2,
        num_attention_heads=16,
        max_position_embeddings=1024,
        attn_implementation="eager",
        use_cache=False,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    graphs = []

    def capture(gm, example_inputs):
        run, why = find.find_block_run(gm)
        assert run is not None, why
        fake_mode = aot.fake_mode_of(example_inputs)
        values = find.fake_values(gm, example_inputs, fake_mode)
        sub, inputs, _ = aot.block_graph(gm, find.block_parts(gm, run)[1], "block")
        graphs.append(aot.partition(sub, [values[n] for n in inputs], fake_mode, decompose=True))
        return gm.forward

    torch.compiler.reset()
    ids = torch.zeros(batch, 1024, dtype=torch.long, device="meta")
    torch.compile(model, backend=capture)(input_ids=ids)
    torch.compiler.reset()
    return graphs[0]


def test_the_measured_llama_blocks_decide_as_measured_and_alike_every_time():
    small = find.estimate(*_llama_block_graphs(4), find.H200)
    large = find.estimate(*_llama_block_graphs(12), find.H200)
    why = find.refusal(small, find.H200)
    assert why is not None and "ms to issue its" in why and "share_blocks=True" in why, (small, why)
    assert find.refusal(large, find.H200) is None, large
    assert small.ops == large.ops and large.flops == pytest.approx(3 * small.flops, rel=0.01), (small, large)
    # A pure function of the graphs: traced again, the same figures.
    assert find.estimate(*_llama_block_graphs(4), find.H200) == small


def test_a_gpu_without_constants_of_its_own_uses_the_h200s_and_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    device, note = find.device_cost(torch.device("cuda", 0))
    assert device is find.H200 and "NVIDIA A100-SXM4-80GB" in note, note
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert find.device_cost(torch.device("cuda", 0)) == (find.H200, None)
