"""GPU checks (NCCL, Inductor), run on the device machines: ``pytest tests/gpu -m gpu``.

Skipped without 2 CUDA devices. Each compares bucketwise against eager DDP on real ranks.
"""

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


def _worker(rank: int, world: int, store: str, case: str, errors) -> None:
    try:
        import faulthandler

        faulthandler.dump_traceback_later(300, exit=True)  # a hung rank shows where it waits
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        _CASES[case](rank)
        # No release call first: bucketwise releases CUDA graphs holding NCCL kernels itself
        # (NOTE [cuda graphs at teardown]).
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        errors.put(f"rank {rank}: {traceback.format_exc()}")


def _gpt_case(rank: int, *, strategy: str, dynamic: bool = False, cudagraphs: bool = False) -> None:
    import bucketwise
    from bucketwise.launch.models import GPT, GPTConfig, synthetic_tokens

    cfg = GPTConfig(vocab=1024, seq=64, layers=3, d_model=128, heads=4)
    torch.manual_seed(0)
    model = GPT(cfg).cuda()
    eager = DDP(model, device_ids=[rank], bucket_cap_mb=0.5)
    comp = bucketwise.compile(
        DDP(copy.deepcopy(model), device_ids=[rank], bucket_cap_mb=0.5),
        backend="inductor",
        strategy=strategy,
        dynamic=dynamic,
        cudagraphs=cudagraphs,
    )
    # SGD, not Adam: Adam's normalisation turns the last-bit differences of fused GPU kernels
    # (and the atomic-add order of the embedding backward) on near-zero gradients into lr-sized
    # steps, which says nothing about bucketing.
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_c = torch.optim.SGD(comp.parameters(), lr=0.1)
    for step in range(5):
        batch = 4 + (step % 2 if dynamic else 0)
        x, y = synthetic_tokens(cfg, batch, seed=100 * rank + step, device="cuda")
        losses = step_side_by_side(((eager, opt_e), (comp, opt_c)), x, y)
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)
    for (name, a), b in zip(eager.module.named_parameters(), comp.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-3, atol=1e-5, msg=lambda m: f"{name}.grad: {m}")
    rep = bucketwise.report(comp)
    if strategy == "fused":
        assert len(rep.graphs[0].buckets) > 1, rep.table()
        # 2 x 256 ids < 1024 rows: the token table is gathered as rows (NOTE [embedding rows]),
        # and the replicas must stay bit-identical (no atomic scatter-add order per rank).
        assert [b.params for b in rep.graphs[0].buckets if b.collective == "all_gather rows"] == [["tok.weight"]], (
            rep.table()
        )
        flat = torch.cat([p.detach().reshape(-1) for p in comp.parameters()])
        theirs = flat.clone()
        dist.broadcast(theirs, 0)
        assert torch.equal(flat, theirs), f"replicas differ by {(flat - theirs).abs().max().item()}"
    if strategy == "split":
        assert rep.totals["segments"] > 1, rep.table()
        assert rep.alignment == 1.0, rep.alignment_detail()
    if dynamic:
        assert rep.totals["recompiles"] == 0, rep.table()
    if cudagraphs:
        # Every forward and backward graph replays from a CUDA graph (with the fused strategy
        # the backward holds the NCCL allreduces), parameters read in place.
        stats = {c.name: c for c in rep.cudagraphs}
        assert stats and all(c.captured and c.replays >= 3 for c in stats.values()), rep.table()
        assert all(c.inputs_copied <= 2 for c in stats.values()), rep.table()
    if rank == 0:
        print(rep.table())


def _join_case(rank: int, *, strategy: str, cudagraphs: bool = False) -> None:
    """Uneven inputs inside ``join()``: rank 0 has 5 batches, rank 1 has 3 (NOTE [fused under
    join]); the compiled model ends where eager DDP ends, on both ranks, without a hang."""
    import bucketwise
    from bucketwise.launch.models import GPT, GPTConfig, synthetic_tokens

    cfg = GPTConfig(vocab=1024, seq=64, layers=3, d_model=128, heads=4)
    torch.manual_seed(0)
    model = GPT(cfg).cuda()
    eager = DDP(model, device_ids=[rank], bucket_cap_mb=0.5)
    ddp = DDP(copy.deepcopy(model), device_ids=[rank], bucket_cap_mb=0.5)
    comp = bucketwise.compile(ddp, backend="inductor", strategy=strategy, cudagraphs=cudagraphs)
    for m, d in ((eager, eager), (comp, ddp)):
        opt = torch.optim.SGD(d.parameters(), lr=0.1)
        with d.join():
            for step in range(5 - 2 * rank):
                x, y = synthetic_tokens(cfg, 4, seed=100 * rank + step, device="cuda")
                m(x, y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
    for (name, a), b in zip(eager.module.named_parameters(), ddp.module.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    rep = bucketwise.report(comp)
    assert {g.strategy for g in rep.graphs if g.variant is None} == {"fused"}, rep.table()
    if rank == 0:
        assert any("join()" in n for n in rep.notes), rep.notes


_CASES = {
    "join-fused": lambda r: _join_case(r, strategy="auto"),
    "join-fused-cg": lambda r: _join_case(r, strategy="fused", cudagraphs=True),
    "gpt-split": lambda r: _gpt_case(r, strategy="split"),
    "gpt-none": lambda r: _gpt_case(r, strategy="none"),
    "gpt-split-dynamic": lambda r: _gpt_case(r, strategy="split", dynamic=True),
    "gpt-fused": lambda r: _gpt_case(r, strategy="fused"),
    "gpt-split-cg": lambda r: _gpt_case(r, strategy="split", cudagraphs=True),
    "gpt-fused-cg": lambda r: _gpt_case(r, strategy="fused", cudagraphs=True),
}


@pytest.mark.parametrize("case", sorted(_CASES))
def test_gpu_matches_eager_ddp(case: str, tmp_path) -> None:
    run_two_ranks(_worker, str(tmp_path / "store"), case)
