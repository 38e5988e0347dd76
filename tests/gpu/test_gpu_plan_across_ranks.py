"""On 2 GPUs (NCCL, Inductor) the same model and config give the same plan on both ranks and on a
second compile (NOTE [one plan per graph] in compiler/plan.py), also where the default's sharing is
decided on the GPU (``share_blocks="auto"`` without CUDA graphs, NOTE [sharing by cost]): from an
estimate of the block's graphs, not from a timing, so the same on every rank and restart.

As tests/distributed/test_plan_across_ranks.py on the CPU: GPTs of 3 identical blocks compiled
under DDP with the default config (a small GPT, whose blocks' calls would wait on the host, and a
wide one, whose calls may hide behind their kernels), ``share_blocks=True``, ``strategy="split"``
and DDP's ``bf16_compress_hook``, each trained 2 steps on rank-specific data, then compiled again
from a fresh copy after ``torch._dynamo.reset()``. Each rank writes what the report records of its
graphs' plans, timings left out; both ranks' records, and each rank's two compiles', are equal.
Skipped without 2 CUDA devices.
"""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support.gpu_ranks import run_two_ranks
from support.plan_records import differences, plan_record
from torch.nn.parallel import DistributedDataParallel as DDP

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

STEPS = 2
SMALL = {"vocab": 512, "seq": 32, "layers": 3, "d_model": 64, "heads": 4, "dropout": 0.0}
WIDE = {"vocab": 512, "seq": 512, "layers": 3, "d_model": 1024, "heads": 8, "dropout": 0.0}

# name -> (GPT config and batch, bucketwise.compile's keyword arguments, DDP's, comm hook).
CONFIGS: dict[str, tuple[dict[str, Any], int, dict[str, Any], dict[str, Any], str | None]] = {
    "default_small": (SMALL, 2, {}, {}, None),
    "default_wide": (WIDE, 4, {}, {}, None),
    "share_blocks": (SMALL, 2, {"share_blocks": True}, {}, None),
    "split": (SMALL, 2, {"strategy": "split"}, {"bucket_cap_mb": 0.1}, None),
    "bf16_hook": (SMALL, 2, {}, {}, "bf16_compress_hook"),
}


def _compile_and_train(rank: int, name: str) -> dict[str, Any]:
    import bucketwise
    from bucketwise.launch.models import GPT, GPTConfig, synthetic_tokens

    shape, batch, options, ddp_options, hook = CONFIGS[name]
    cfg = GPTConfig(**shape)
    torch.manual_seed(0)
    net = GPT(cfg).cuda()
    ddp = DDP(net, device_ids=[rank], **ddp_options)
    if hook is not None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, getattr(default_hooks, hook))
    compiled = bucketwise.compile(ddp, **options)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = synthetic_tokens(cfg, batch, seed=100 * rank + step, device="cuda")
        compiled(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return plan_record(bucketwise.report(compiled).to_dict())


def _worker(rank: int, world: int, store: str, out_dir: str, errors) -> None:
    try:
        import faulthandler

        faulthandler.dump_traceback_later(300, exit=True)  # a hung rank shows where it waits
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        os.environ.setdefault("BUCKETWISE_PROGRESS", "0")
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        records = {}
        for name in CONFIGS:
            first = _compile_and_train(rank, name)
            torch._dynamo.reset()
            again = _compile_and_train(rank, name)
            torch._dynamo.reset()
            records[name] = [first, again]
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(records))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        errors.put(f"rank {rank}: {traceback.format_exc()}")


def test_gpu_ranks_and_compiles_get_the_same_plan(tmp_path) -> None:
    run_two_ranks(_worker, str(tmp_path / "store"), str(tmp_path))
    r0, r1 = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1))
    assert list(r0) == list(r1) == list(CONFIGS)
    for name in CONFIGS:
        assert r0[name][0] == r1[name][0], (
            f"{name}: rank 0 and rank 1 planned differently",
            differences(r0[name][0], r1[name][0]),
        )
        for rank, (first, again) in enumerate((r0[name], r1[name])):
            assert first == again, (
                f"{name}: rank {rank} planned differently when compiled again",
                differences(first, again),
            )
    records = {name: r0[name][0] for name in CONFIGS}
    assert all(len(r["graphs"]) == 1 for r in records.values()), records
    graph = {name: r["graphs"][0] for name, r in records.items()}
    # The default's blocks shared by the cost estimate (its figures in the record) or kept whole
    # with the estimate as the reason: both the same on every rank and compile (above).
    for name in ("default_small", "default_wide"):
        shared = graph[name]["shared_blocks"]
        assert graph[name]["strategy"] == "fused", graph[name]
        if "cost" in shared:
            assert isinstance(shared["cost"], list) and shared["cost"], shared
            assert (shared["count"], shared["compiles"]) == (3, 1), shared
        else:
            assert shared["reason"].startswith("share_blocks='auto' estimated"), shared
            (unshared,) = records[name]["unshared_blocks"]
            assert unshared["reason"] == shared["reason"], unshared
    sharing = graph["share_blocks"]["shared_blocks"]
    assert (sharing["blocks"], sharing["compiles"], sharing["count"]) == ("blocks", 1, 3), sharing
    split = graph["split"]
    assert split["strategy"] == "split" and len(split["segments"]) >= 2, split
    assert {b["comm_dtype"] for b in graph["bf16_hook"]["buckets"]} == {"bfloat16"}, graph["bf16_hook"]["buckets"]
