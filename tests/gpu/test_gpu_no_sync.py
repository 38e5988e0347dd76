"""No device-to-host sync in a compiled training step, under every strategy and option (NOTE
[embedding rows]): steps run under ``torch.cuda.set_sync_debug_mode("error")`` after the
warm-up, on one GPU (NCCL, world size 1). Run on the device machines:
``pytest tests/gpu/test_gpu_no_sync.py -m gpu``.

The batch looks up 4096 token ids from a table of 8192 rows. One rank keeps the table's
allreduce (NOTE [embedding rows]); the op that builds a gathered table's gradient, used from
two ranks on, is checked on its own, above 3072 ids (where ATen's deterministic CUDA embedding
backward sorts them) and below. ``test_gpu_split.py`` runs the gathered rows on 2 GPUs.
"""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.distributed as dist
from support.gpu_ranks import run_ranks, world_of_one
from torch.nn.parallel import DistributedDataParallel as DDP

import bucketwise.distributed.fused.embedding_rows  # noqa: F401  (registers bucketwise::embedding_rows_grad)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

POWERSGD = {"matrix_approximation_rank": 4, "start_powerSGD_iter": 2}

CASES = {
    "default": {},
    "fused": {"strategy": "fused"},
    "fused-dense": {"strategy": "fused", "gather_embedding_rows": False},
    "split": {"strategy": "split"},
    "none": {"strategy": "none"},
    "cudagraphs": {"cudagraphs": True},
    "share-blocks": {"share_blocks": True},
    "bf16-hook": {"hook": "bf16"},
    "powersgd-fused": {"hook": "powersgd"},
    "powersgd-split": {"hook": "powersgd", "strategy": "split"},
    "powersgd-cudagraphs": {"hook": "powersgd", "cudagraphs": True},
}


def _build(case: dict):
    import bucketwise
    from bucketwise.launch.models import GPT, GPTConfig

    cfg = GPTConfig(vocab=8192, seq=512, layers=2, d_model=64, heads=4)
    torch.manual_seed(0)
    ddp = DDP(GPT(cfg).cuda(), device_ids=[0], bucket_cap_mb=1)
    opts = dict(case)
    hook = opts.pop("hook", None)
    if hook == "bf16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

        ddp.register_comm_hook(ps.PowerSGDState(None, **POWERSGD), ps.powerSGD_hook)
    model = bucketwise.compile(ddp, backend="inductor", **opts)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, fused=True)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, cfg.vocab, (8, cfg.seq + 1), generator=g).cuda()
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()

    def step() -> None:
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, step


def _worker(part: int, parts: int, store: str, names: list[str], errors) -> None:
    """Every ``parts``-th case from ``part`` on, in this process as the one rank of its own group."""
    try:
        import faulthandler

        import bucketwise

        faulthandler.dump_traceback_later(600, exit=True)
        world_of_one(f"{store}-{part}", torch.device("cuda", 0))
        failed = []
        for name in names[part::parts]:
            model, step = _build(CASES[name])
            for _ in range(4):  # compile, CUDA-graph warm-up and capture, PowerSGD's switch at step 2
                step()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                for _ in range(3):
                    step()
            except RuntimeError:
                failed.append(f"{name}: {traceback.format_exc(limit=-12)}\n{bucketwise.report(model).table()}")
            finally:
                torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
            print(f"{name}: {bucketwise.report(model).graphs[0].strategy}", flush=True)
            del model, step
            torch._dynamo.reset()
        dist.destroy_process_group()
        assert not failed, "a step synchronised with the host:\n" + "\n\n".join(failed)
    except BaseException:  # noqa: BLE001 - reported to the parent
        errors.put(f"part {part}: {traceback.format_exc()}")


def test_no_host_sync_in_a_compiled_step(tmp_path) -> None:
    # The cases compile one after another in each of three processes at once (compiling is most of
    # the time); each process is a world of one of its own.
    run_ranks(3, _worker, str(tmp_path / "store"), list(CASES), timeout=900)


def test_table_grad_is_sync_free_and_deterministic() -> None:
    """The op behind the default's embedding rows, on either side of 3072 ids (ATen's two CUDA
    kernels): no sync, the same bits every time, the table of a float64 reference to rounding,
    and a padding row left at zero."""
    g = torch.Generator(device="cuda").manual_seed(0)
    for ids, dim, padding in ((4096, 64, -1), (16384, 768, 5), (2048, 1000, -1)):
        rows = torch.randn(ids, dim, device="cuda", generator=g)
        index = torch.randint(0, 512, (ids,), device="cuda", generator=g)  # many repeats per row
        expected = torch.ops.aten.embedding_dense_backward(rows.double(), index, 8192, padding, False)
        torch.cuda.set_sync_debug_mode("error")
        try:
            first = torch.ops.bucketwise.embedding_rows_grad(rows, index, 8192, padding)
            again = [torch.ops.bucketwise.embedding_rows_grad(rows, index, 8192, padding) for _ in range(3)]
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert all(torch.equal(a, first) for a in again)
        torch.testing.assert_close(first, expected.float(), rtol=1e-5, atol=1e-4)
        if padding >= 0:
            assert not first[padding].any()
