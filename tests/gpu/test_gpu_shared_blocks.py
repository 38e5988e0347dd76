"""Shared blocks on a GPU (NOTE [one compile per block]): one rank with NCCL, Inductor.

A GPT of 4 identical blocks trains under ``bucketwise.compile(..., strategy="fused")`` with its
blocks sharing one compile, with ``cudagraphs=True`` and the default ``share_blocks`` ("auto",
which shares there) and without CUDA graphs with ``share_blocks=True``, next to eager DDP and to
the same compile with every block in the whole graph (``share_blocks=False``). Inductor's kernels
differ from eager by themselves, so the distance to eager DDP is relative to each gradient's
largest entry. After the first backward (the same weights everywhere) both compiles must be
within 1e-7 (float64) or 1e-4 (float32) of eager DDP: a defect the two share fails as well as one
of sharing alone (NOTE [reductions into bucket views] was one). Over all 5 steps (AdamW, TF32
off) the same holds: after each step both compiles take eager DDP's weights, so every step's
gradients are compared at equal weights (replays included) instead of along trajectories whose
rounding AdamW amplifies, by a factor that varies from run to run. The report
says the 4 blocks shared 1 compile and, with CUDA graphs, that the forward and the backward
around them both replayed. Skipped without CUDA.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from support.gpu_ranks import run_worker_scripts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

WORKER = textwrap.dedent(
    """
    import copy, sys
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import bucketwise
    from bucketwise.launch.models import GPT, GPTConfig, synthetic_tokens

    cudagraphs = sys.argv[1] == "cg"
    dtype = getattr(torch, sys.argv[3])
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{sys.argv[2]}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = GPTConfig(vocab=512, seq=64, layers=4, d_model=128, heads=4, dropout=0.0)
    torch.manual_seed(0)
    base = GPT(cfg).to("cuda", dtype)
    ref_net, net, whole_net = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    ref = DDP(ref_net, device_ids=[0])
    # With CUDA graphs the default shares the blocks (NOTE [sharing by default]); without, ask.
    sharing = {} if cudagraphs else {"share_blocks": True}
    compiled = bucketwise.compile(DDP(net, device_ids=[0]), strategy="fused", cudagraphs=cudagraphs, **sharing)
    whole = bucketwise.compile(
        DDP(whole_net, device_ids=[0]), strategy="fused", cudagraphs=cudagraphs, share_blocks=False
    )
    nets = (ref_net, net, whole_net)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in nets]
    worst = {"shared": 0.0, "whole": 0.0}
    first = {}
    for step in range(5):
        x, y = synthetic_tokens(cfg, 8, seed=step, device="cuda")
        for model in (ref, compiled, whole):
            model(x, y).backward()
        for name, other in (("shared", net), ("whole", whole_net)):
            for p, q in zip(ref_net.parameters(), other.parameters()):
                err = ((p.grad - q.grad).abs().max() / (p.grad.abs().max() + 1e-12)).item()
                worst[name] = max(worst[name], err)
        if step == 0:
            first = dict(worst)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        with torch.no_grad():  # in place: the compiled steps' parameters keep their addresses
            for other in (net, whole_net):
                for p, q in zip(ref_net.parameters(), other.parameters()):
                    q.copy_(p)
    report = bucketwise.report(compiled).to_dict()
    shared = report["graphs"][0]["shared_blocks"]
    assert bucketwise.report(whole).to_dict()["graphs"][0]["shared_blocks"] is None
    # cudagraphs=True: the forward and the backward around the shared blocks both replay.
    uncaptured = [(g["name"], g["reason"]) for g in report["cudagraphs"] if g["reason"] or not g["replays"]]
    print("UNCAPTURED", uncaptured if cudagraphs else [], flush=True)
    distances = (first["shared"], first["whole"], worst["shared"], worst["whole"])
    print("RESULT", *distances, shared["count"], shared["compiles"], flush=True)
    dist.destroy_process_group()
    """
)


CASES = {f"{mode}-{dtype}": (mode, dtype) for mode in ("plain", "cg") for dtype in ("float64", "float32")}


def _failures(name: str, dtype: str, printed: list[str]) -> list[str]:
    # RESULT shared whole (after the first backward) shared whole (over all steps) count compiles
    result = [line for line in printed if line.startswith("RESULT")][-1]
    first_shared, first_whole, shared, whole, count, compiles = result.split()[1:]
    tolerance = 1e-7 if dtype == "float64" else 1e-4
    checks = {
        f"after the first backward, over {tolerance:g}": float(first_shared) < tolerance
        and float(first_whole) < tolerance,
        f"over all steps, over {tolerance:g}": float(shared) < tolerance and float(whole) < tolerance,
        "not 4 blocks sharing 1 compile": (int(count), int(compiles)) == (4, 1),
    }
    out = [f"{name}: {what}: {result}" for what, ok in checks.items() if not ok]
    uncaptured = [line for line in printed if line.startswith("UNCAPTURED")]
    if uncaptured != ["UNCAPTURED []"]:
        out.append(f"{name}: {uncaptured}")
    return out


def test_shared_blocks_train_like_eager_ddp_on_a_gpu(tmp_path):
    # The four cases run at once, each in a process of its own.
    cases = {name: (mode, str(tmp_path / f"store-{name}"), dtype) for name, (mode, dtype) in CASES.items()}
    printed = run_worker_scripts(tmp_path, WORKER, cases)
    failures = [line for name, (_, dtype) in CASES.items() for line in _failures(name, dtype, printed[name])]
    assert not failures, "\n".join(failures)
