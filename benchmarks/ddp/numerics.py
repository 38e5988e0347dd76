"""Training numerics of bucketwise strategies against eager DDP on GPUs (a diagnostic).

    python3 -m bucketwise.benchmarks numerics --nproc 2 [--configs bw-none,bw-fused] [--backend aot_eager]

Trains the same GPT (bf16 autocast, AdamW, one fixed batch per rank, as the ``ddp`` harness) under
eager DDP and under each config (names as in every harness, ``core/configs.py``), from the same
initial weights, with ``--backend``, and prints per config (``variant`` in the JSON): the
largest gradient difference from eager DDP after the first backward (absolute, and relative to
the gradient's own largest value), the loss trajectory's largest gap from eager's, and whether
the parameters are still equal on every rank at the end. Prints one JSON line per config.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from bucketwise.benchmarks.core import procs
from bucketwise.benchmarks.core.configs import CONFIGS
from bucketwise.benchmarks.core.metrics import param_spread
from bucketwise.benchmarks.core.names import check_names
from bucketwise.distributed.gloo_exit import end_process_group

DEFAULT_CONFIGS = ("bw-none", "bw-split", "bw-fused", "bw-fused-noreorder")


def _train(model, steps, batch, autocast):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses, first_grads = [], None
    for step in range(steps):
        with torch.autocast(batch[0].device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(*batch)
        loss.backward()
        if step == 0:
            first_grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, first_grads


def _worker(rank, world, store, args):
    from bucketwise.benchmarks.core.configs import recipe_for

    cuda = torch.cuda.is_available()  # CPU (gloo): a smoke run of this script
    if cuda:
        torch.cuda.set_device(rank)
    dev = "cuda" if cuda else "cpu"
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    from bucketwise.launch.models import GPT, GPTConfig, synthetic_tokens

    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers, d_model=args.d_model, heads=args.heads)
    torch.manual_seed(0)
    base = GPT(cfg).to(dev)
    batch = synthetic_tokens(cfg, args.batch, seed=1000 + rank, device=dev)
    ref_losses, ref_grads = _train(
        DDP(copy.deepcopy(base), device_ids=[rank] if cuda else None), args.steps, batch, not args.fp32
    )
    for name in args.configs.split(","):
        model = (
            recipe_for(name)
            .prepare(
                copy.deepcopy(base),
                device=torch.device(dev, rank if cuda else None),
                backend=args.backend,
                bucket_cap_mb=None,
            )
            .module
        )
        losses, grads = _train(model, args.steps, batch, not args.fp32)
        worst = max(grads, key=lambda n: (grads[n] - ref_grads[n]).abs().max().item())
        diff = (grads[worst] - ref_grads[worst]).abs().max().item()
        rel = max(
            ((grads[n] - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp_min(1e-30)).item() for n in grads
        )
        spread = param_spread(model.parameters())
        gap = max(abs(a - b) for a, b in zip(losses, ref_losses))
        if rank == 0:
            print(
                json.dumps(
                    {
                        "variant": name,
                        "backend": args.backend,
                        "grad_absdiff_step1": diff,
                        "worst_param": worst,
                        "grad_reldiff_step1": rel,
                        "loss_gap_max": gap,
                        "final_loss": losses[-1],
                        "eager_final_loss": ref_losses[-1],
                        "param_spread_across_ranks": spread,
                        "losses": [round(x, 5) for x in losses],
                        "eager_losses": [round(x, 5) for x in ref_losses],
                    }
                ),
                flush=True,
            )
        del model
        torch.compiler.reset()
    import gc

    gc.collect()
    end_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help="comma-separated configs (``core/configs.py``)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend of every config")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--fp32", action="store_true", help="no bf16 autocast")
    args = p.parse_args(argv)
    try:
        check_names(args.configs.split(","), CONFIGS)
    except ValueError as exc:
        p.error(str(exc))
    with tempfile.TemporaryDirectory() as d:
        done = procs.spawn_ranks(_worker, (args,), nproc=args.nproc, run_dir=Path(d))
    if done.code != 0:
        raise SystemExit(f"numerics: a rank failed (exit codes {done.codes})")


if __name__ == "__main__":
    main()
