"""powerSGD_hook under ``strategy="fused"`` on 2 GPUs (NCCL, Inductor), against eager DDP with
torch's own hook: ``pytest tests/gpu/test_gpu_powersgd.py -m gpu``. Skipped without 2 CUDA
devices. NCCL runs torch's hook as it is (its P/Q all-reduces start in issue order)."""

from __future__ import annotations

import copy
import os
import traceback

import pytest
import torch
import torch.distributed as dist
from support.gpu_ranks import run_two_ranks, step_side_by_side
from torch.nn.parallel import DistributedDataParallel as DDP

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

STATES = {
    False: {"matrix_approximation_rank": 4, "start_powerSGD_iter": 2},  # QR orthogonalisation
    True: {"matrix_approximation_rank": 2, "start_powerSGD_iter": 2},  # Gram-Schmidt, captured
}


def _worker(rank: int, world: int, store: str, cudagraphs: bool, errors) -> None:
    try:
        import faulthandler

        faulthandler.dump_traceback_later(300, exit=True)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        _case(rank, cudagraphs)
        import gc

        torch._dynamo.reset()  # frees the recordings early (bucketwise also does, NOTE [cuda graphs at teardown])
        gc.collect()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        errors.put(f"rank {rank}: {traceback.format_exc()}")


def _case(rank: int, cudagraphs: bool) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

    import bucketwise
    from bucketwise.launch.models import GPT, GPTConfig, synthetic_tokens

    cfg = GPTConfig(vocab=1024, seq=64, layers=3, d_model=128, heads=4)
    torch.manual_seed(0)
    model = GPT(cfg).cuda()
    eager = DDP(model, device_ids=[rank], bucket_cap_mb=0.5)
    ddp = DDP(copy.deepcopy(model), device_ids=[rank], bucket_cap_mb=0.5)
    eager_state, state = ps.PowerSGDState(None, **STATES[cudagraphs]), ps.PowerSGDState(None, **STATES[cudagraphs])
    eager.register_comm_hook(eager_state, ps.powerSGD_hook)
    ddp.register_comm_hook(state, ps.powerSGD_hook)
    comp = bucketwise.compile(ddp, backend="inductor", strategy="fused", cudagraphs=cudagraphs)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_c = torch.optim.SGD(comp.parameters(), lr=0.1)
    for step in range(8):
        x, y = synthetic_tokens(cfg, 4, seed=100 * rank + step, device="cuda")
        losses = step_side_by_side(((eager, opt_e), (comp, opt_c)), x, y)
        # Inductor's kernels round differently; orthogonalisation passes that on to P and Q.
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-4, atol=1e-4, msg=lambda m: f"step {step}: {m}")
    assert state.iter == eager_state.iter == 8
    assert sorted(state.error_dict) == sorted(eager_state.error_dict)
    for (name, a), b in zip(eager.module.named_parameters(), comp.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4, msg=lambda m: f"{name}: {m}")
    # The replicas stay bit-identical.
    flat = torch.cat([p.detach().reshape(-1) for p in comp.parameters()])
    theirs = flat.clone()
    dist.broadcast(theirs, 0)
    assert torch.equal(flat, theirs), f"replicas differ by {(flat - theirs).abs().max().item()}"
    rep = bucketwise.report(comp)
    graph = rep.graphs[0]
    assert graph.strategy == "fused" and len(graph.buckets) > 1, rep.table()
    assert [v.name for v in graph.variants] == ["plain all-reduce (before start_powerSGD_iter)", "powerSGD"], (
        rep.table()
    )
    assert sum(b.wire_bytes for b in graph.buckets) < sum(b.bytes for b in graph.buckets) / 4, rep.table()
    if cudagraphs:
        replayed = [c for c in rep.cudagraphs if c.replays > 0 and "(powerSGD)" in c.name]
        assert len(replayed) == 2, rep.table()
    if rank == 0:
        print(rep.table())


@pytest.mark.parametrize("cudagraphs", [False, True], ids=["fused", "fused-cg"])
def test_gpu_powersgd_matches_eager_ddp(cudagraphs: bool, tmp_path) -> None:
    run_two_ranks(_worker, str(tmp_path / "store"), cudagraphs)
