"""Gradients exist once under ``fused`` on a GPU (NOTE [released reducer]): one rank with NCCL.

A small GPT trains under eager DDP and under ``bucketwise.compile(..., strategy="fused")``
(Inductor, with and without ``cudagraphs=True``) through what users do with gradients:
``zero_grad(set_to_none=True)``, clipping, accumulation under ``no_sync()``,
``zero_grad(set_to_none=False)``. Gradients and parameters equal eager DDP's at every step;
DDP's bucket buffers are freed (the allocator gets the gradient bytes back) and each bucket's
gradients are views of one buffer. Skipped without CUDA; one GPU is enough (world size 1 runs
the graph N ranks would run).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

WORKER = textwrap.dedent(
    """
    import contextlib, copy, sys
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import bucketwise
    from bucketwise._compat import released_reducer
    from bucketwise.launch.models import GPT, GPTConfig, synthetic_tokens

    cudagraphs = sys.argv[1] == "cg"
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{sys.argv[2]}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = GPTConfig(vocab=4096, seq=32, layers=2, d_model=256, heads=4, dropout=0.0)
    torch.manual_seed(0)
    base = GPT(cfg).cuda()
    ref = DDP(copy.deepcopy(base), device_ids=[0], bucket_cap_mb=0.05)
    module = copy.deepcopy(base)
    ddp = DDP(module, device_ids=[0], bucket_cap_mb=0.05)
    grad_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    # One eager step first (no optimizer step): the libraries' workspaces exist before measuring.
    ref(*synthetic_tokens(cfg, 4, seed=99, device="cuda")).backward()
    ref.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    compiled = bucketwise.compile(ddp, backend="inductor", strategy="fused", cudagraphs=cudagraphs)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, module)]
    # step: (micro-batches, clip, zero_grad's set_to_none)
    plan = [(1, False, True), (1, False, True), (1, True, True), (2, False, True), (1, False, False),
            (1, False, False), (1, False, True)]
    freed = None
    for step, (micro, clip, set_to_none) in enumerate(plan):
        for k in range(micro):
            x, y = synthetic_tokens(cfg, 4, seed=10 * step + k, device="cuda")
            for model, d in ((ref, ref), (compiled, ddp)):
                with d.no_sync() if k < micro - 1 else contextlib.nullcontext():
                    model(x, y).backward()
        if step == 0:
            assert released_reducer.reducer_released(ddp), "reducer not released"
            named = dict(module.named_parameters())
            for g in bucketwise.report(compiled).to_dict()["graphs"][0]["buckets"]:
                storages = {named[n].grad.untyped_storage().data_ptr() for n in g["params"]}
                assert len(storages) == 1, (g["params"], len(storages))
        for (name, p), q in zip(ref.module.named_parameters(), module.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"step {step} {name}: {m}")
        if clip:
            norms = [torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05) for m in (ref.module, module)]
            torch.testing.assert_close(norms[1], norms[0], rtol=1e-4, atol=1e-5)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
        for (name, p), q in zip(ref.module.named_parameters(), module.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5, msg=lambda m: f"step {step} {name}: {m}")
        if step == 1 and not cudagraphs:
            torch.cuda.synchronize()
            freed = before - torch.cuda.memory_allocated()
    if freed is not None:
        # At rest after a set_to_none step: DDP's buckets are gone, nothing holds the gradients.
        assert freed >= 0.9 * grad_bytes, (freed, grad_bytes)
    print("OK", cudagraphs, freed, grad_bytes)
    dist.destroy_process_group()
    """
)


def _run_worker(tmp_path, script: str, *args: str) -> None:
    """``script`` in a new process (one rank, NCCL, its own Inductor cache); it prints OK."""
    env = {
        **os.environ,
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
        "BUCKETWISE_PROGRESS": "0",
    }
    proc = subprocess.run(
        [sys.executable, "-c", script, *args, str(tmp_path / "store")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "OK" in proc.stdout, proc.stdout


@pytest.mark.parametrize("mode", ["plain", "cg"])
def test_fused_gradients_as_bucket_views_equal_eager_ddp(tmp_path, mode):
    _run_worker(tmp_path, WORKER, mode)


COPIES_WORKER = textwrap.dedent(
    """
    import sys
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import bucketwise
    from bucketwise.launch.models import GPT, GPTConfig, synthetic_tokens

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    # Activations much larger than gradients: the backward frees saved activations early and its
    # gradients land at their addresses in the shared pool.
    cfg = GPTConfig(vocab=8192, seq=256, layers=4, d_model=512, heads=8, dropout=0.0)
    torch.manual_seed(0)
    module = GPT(cfg).cuda()
    compiled = bucketwise.compile(DDP(module, device_ids=[0]), backend="inductor", strategy="fused", cudagraphs=True)
    opt = torch.optim.SGD(module.parameters(), lr=0.01)
    x, y = synthetic_tokens(cfg, 8, seed=0, device="cuda")

    def step():
        compiled(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(4):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
        torch.cuda.synchronize()
    copies = sum(e.count for e in prof.key_averages() if e.key in ("aten::copy_", "aten::clone"))
    graphs = bucketwise.report(compiled).to_dict()["cudagraphs"]
    params = len(list(module.parameters()))
    print("COPIES", copies, "PARAMS", params, graphs)
    assert all(g["captured"] for g in graphs), graphs
    # A replay copies the caller's inputs and outputs (a handful); with gradients not lent,
    # AccumulateGrad copies every gradient instead.
    assert copies < params // 4, (copies, params)
    print("OK")
    dist.destroy_process_group()
    """
)


def test_cudagraph_gradients_reach_param_grad_without_a_copy(tmp_path):
    _run_worker(tmp_path, COPIES_WORKER)
