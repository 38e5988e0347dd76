"""``bucketwise launch --profile-steps`` on 2 GPUs (NCCL): the per-bucket runtime view from NCCL
kernels.

A small GPT, ``fused`` with Inductor, its token table gathered as rows (NOTE [embedding rows]),
plain or with ``bf16_compress_hook``: every planned bucket is found in the trace once per
profiled step (the table once per lookup), sending exactly the bytes the report plans; the
figures add up; the trace and the timeline are written. Run on the device machines:
``pytest tests/gpu/test_gpu_runtime_view.py``; set ``BUCKETWISE_RUNTIME_VIEW_LOG`` to a folder to
keep each run's output and stats folder.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

STEPS = 4

SCRIPT = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    import bucketwise
    from bucketwise.launch.models import GPT, GPTConfig, synthetic_tokens

    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    cfg = GPTConfig(vocab=1024, seq=64, layers=2, d_model=128, heads=4)
    torch.manual_seed(0)
    model = DDP(GPT(cfg).cuda(), device_ids=[rank], bucket_cap_mb=0.25)
    if sys.argv[1] == "bf16":
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    compiled = bucketwise.compile(model, strategy="fused")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(12):
        x, y = synthetic_tokens(cfg, 4, seed=1000 * rank + step, device="cuda")
        compiled(x, y).backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("hook", ["none", "bf16"])
def test_launch_profile_steps_on_nccl(tmp_path, hook):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    stats = tmp_path / "stats"
    env = {
        **os.environ,
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
        "BUCKETWISE_PROGRESS": "0",
    }
    cmd = [
        sys.executable,
        "-m",
        "bucketwise.launch.cli",
        "launch",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--profile-steps",
        str(STEPS),
        "--stats-dir",
        str(stats),
        str(script),
        hook,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    keep = os.environ.get("BUCKETWISE_RUNTIME_VIEW_LOG")
    if keep:
        os.makedirs(keep, exist_ok=True)
        (tmp_path / "output.txt").write_text(result.stdout + result.stderr)
        shutil.copytree(tmp_path, os.path.join(keep, hook), dirs_exist_ok=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "runtime per bucket" in result.stdout, result.stdout
    for rank in (0, 1):
        view = json.loads((stats / f"runtime-rank{rank}.json").read_text())
        report = json.loads((stats / f"rank{rank}.json").read_text())
        planned = {(g["graph_id"], b["index"]): b for g in report["graphs"] if not g["variant"] for b in g["buckets"]}
        assert view["source"] == "cuda" and view["steps"] == STEPS, view
        assert {b["collective"] for b in planned.values()} == {"all_reduce", "all_gather rows"}, planned
        if hook == "bf16":
            assert {b["comm_dtype"] for b in planned.values()} == {"bfloat16"}, planned
        rows = {(b["graph_id"], b["index"]): b for b in view["buckets"]}
        assert sorted(rows) == sorted(planned)
        for key, b in rows.items():
            assert b["calls"] >= 1, (b, view["notes"])
            assert b["calls"] == 1 or planned[key]["collective"] == "all_gather rows", b
            assert b["measured_bytes"] == planned[key]["wire_bytes"], (b, planned[key])
            assert 0 < b["comm_ms"] and 0 <= b["overlapped_ms"] <= b["comm_ms"] + 1e-9, b
        assert view["other"] is None, view["other"]
        assert 0 < view["exposed_ms"] + view["overlapped_ms"] == pytest.approx(view["comm_ms"])
        assert view["comm_ms"] < view["step_ms"], view
        assert (stats / f"runtime-rank{rank}.trace.json").stat().st_size > 0
        assert (stats / f"runtime-rank{rank}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
