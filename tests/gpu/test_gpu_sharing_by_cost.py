"""``share_blocks="auto"`` without CUDA graphs on a GPU estimates a block's call from its graphs
(NOTE [sharing by cost]): one rank with NCCL, Inductor, ``bucketwise.compile(DDP(net))`` with no
options.

A GPT of 4 identical blocks whose calls hide behind their kernels (width 2048, 8 x 1024 tokens,
float32) shares one compile, the report giving the estimate. Gradients are compared with eager DDP's
after every backward (float32, TF32 off), the default's and those of the same compile with every
block in the whole graph (``share_blocks=False``): each within 1e-4 of each gradient's largest
entry (the LayerNorms' gradients of the wide GPT take Inductor's mix-order reduction, NOTE
[reductions into bucket views]). A GPT of
tiny blocks (width 64, 2 x 32 tokens: a few microseconds of kernels against the host's calls)
compiles its blocks with the whole graph, and the report says why, with the figures, in its
notes and in ``unshared_blocks`` (for host time only). A third compile of the wide GPT decides
alike from the same estimate: nothing is measured. Skipped without CUDA.
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from support.gpu_ranks import run_worker_script

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

WORKER = textwrap.dedent(
    """
    import copy, json, os, sys
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import bucketwise
    from bucketwise.launch.models import GPT, GPTConfig, synthetic_tokens

    size = sys.argv[1]
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{sys.argv[2]}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if size == "large":
        cfg, batch = GPTConfig(vocab=512, seq=1024, layers=4, d_model=2048, heads=16, dropout=0.0), 8
    else:
        cfg, batch = GPTConfig(vocab=512, seq=32, layers=4, d_model=64, heads=4, dropout=0.0), 2
    torch.manual_seed(0)
    base = GPT(cfg).to("cuda")
    ref_net, net, whole_net = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    ref = DDP(ref_net, device_ids=[0])
    compiled = bucketwise.compile(DDP(net, device_ids=[0]))
    whole = bucketwise.compile(DDP(whole_net, device_ids=[0]), share_blocks=False)
    worst = {"default": 0.0, "whole": 0.0}
    where = {}
    for step in range(3):
        x, y = synthetic_tokens(cfg, batch, seed=step, device="cuda")
        for model in (ref, compiled, whole):
            model(x, y).backward()
        for name, other in (("default", net), ("whole", whole_net)):
            for (pname, p), q in zip(ref_net.named_parameters(), other.parameters()):
                err = ((p.grad - q.grad).abs().max() / (p.grad.abs().max() + 1e-12)).item()
                if err > worst[name]:
                    worst[name] = err
                    where[name] = [step, pname, p.grad.abs().max().item(), (p.grad - q.grad).abs().max().item()]
        for m in (ref_net, net, whole_net):
            m.zero_grad(set_to_none=True)
    report = bucketwise.report(compiled).to_dict()
    out = {
        **worst,
        "worst_at": where,
        "shared_blocks": report["graphs"][0]["shared_blocks"],
        "unshared_blocks": report["unshared_blocks"],
        "notes": report["notes"],
    }
    if size == "large":  # the same block compiled again decides alike
        again = bucketwise.compile(DDP(copy.deepcopy(base), device_ids=[0]))
        again(x, y).backward()
        out["again"] = bucketwise.report(again).to_dict()["graphs"][0]["shared_blocks"]
    print("RESULT", json.dumps(out), flush=True)
    dist.destroy_process_group()
    """
)


def _run(tmp_path, size: str) -> dict:
    printed = run_worker_script(tmp_path, WORKER, size, str(tmp_path / "store"))
    (line,) = [line for line in printed if line.startswith("RESULT")]
    return json.loads(line.removeprefix("RESULT "))


def test_blocks_whose_calls_hide_behind_their_kernels_share_one_compile_by_default(tmp_path):
    from bucketwise.compiler.blocks.find import HOST_SHARE_LIMIT

    out = _run(tmp_path, "large")
    shared = out["shared_blocks"]
    assert (shared.get("count"), shared.get("compiles")) == (4, 1), shared
    (cost,) = shared["cost"]
    assert cost["host_ms"] <= HOST_SHARE_LIMIT * cost["gpu_ms"], cost
    assert out["unshared_blocks"] == [], out["unshared_blocks"]
    assert out["again"]["cost"] == [cost], (out["again"], cost)
    assert out["default"] <= 1e-4 and out["whole"] <= 1e-4, out


def test_blocks_whose_calls_would_wait_on_the_host_compile_whole_and_the_report_says_why(tmp_path):
    out = _run(tmp_path, "small")
    reason = out["shared_blocks"]["reason"]
    assert "estimated a shared block's call" in reason and "ms to issue its" in reason, reason
    (entry,) = out["unshared_blocks"]
    assert entry["blocks"] == 4 and entry["host_time"] is True and entry["reason"] == reason, entry
    assert any(reason in note for note in out["notes"]), out["notes"]
    assert out["default"] <= 1e-4 and out["whole"] <= 1e-4, out
