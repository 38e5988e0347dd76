"""The ``bucketwise demo`` job every rank runs: a small GPT under DDP, compiled by bucketwise,
against an eager DDP copy; exit 1 if their losses drift apart.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import os
import sys
import time
from typing import Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ..compiler.config import STRATEGIES
from .launcher import positive_int

DEFAULT_BACKEND = "inductor"
DEFAULT_STEPS = 8
DEFAULT_BUCKET_CAP_MB = 0.05
BATCH_PER_RANK = 8


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by ``bucketwise demo`` and this module's own command line."""
    parser.add_argument(
        "--backend",
        default=DEFAULT_BACKEND,
        help=f"torch.compile backend for each bucket segment (default: {DEFAULT_BACKEND})",
    )
    parser.add_argument(
        "--steps", type=positive_int, default=DEFAULT_STEPS, help=f"training steps (default: {DEFAULT_STEPS})"
    )
    parser.add_argument(
        "--strategy", default="auto", choices=STRATEGIES, help="bucketwise.compile strategy (default: auto)"
    )
    parser.add_argument(
        "--bucket-cap-mb",
        type=_positive_float,
        default=DEFAULT_BUCKET_CAP_MB,
        help=f"DDP bucket cap in MiB, small so the tiny model has several buckets (default: {DEFAULT_BUCKET_CAP_MB})",
    )
    parser.add_argument(
        "--rtol",
        type=_positive_float,
        default=None,
        help="relative tolerance of compiled vs eager losses (default: 1e-4 on CPU, 1e-3 on GPU)",
    )


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


@dataclasses.dataclass
class Setup:
    rank: int
    world: int
    device: torch.device


def init_distributed() -> Setup:
    """gloo on CPU, or NCCL with one GPU per local rank when enough GPUs are visible."""
    if "RANK" not in os.environ:
        raise SystemExit("bucketwise.launch.demo: RANK is not set; run it with `bucketwise demo` or under torchrun")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return Setup(dist.get_rank(), dist.get_world_size(), device)


def build_models(setup: Setup, args: argparse.Namespace):
    """The compiled DDP GPT and its eager twin, with identical initial weights."""
    import bucketwise

    from .models import GPT, GPTConfig

    cfg = GPTConfig(vocab=512, seq=64, layers=2, d_model=64, heads=4)
    torch.manual_seed(0)
    base = GPT(cfg).to(setup.device)
    ddp_kwargs = {"bucket_cap_mb": args.bucket_cap_mb}
    if setup.device.type == "cuda":
        ddp_kwargs["device_ids"] = [setup.device.index]
    eager = DDP(copy.deepcopy(base), **ddp_kwargs)
    compiled = bucketwise.compile(
        DDP(base, **ddp_kwargs), backend=args.backend, strategy=args.strategy, bucket_cap_mb=args.bucket_cap_mb
    )
    return cfg, compiled, eager


def train_step(model, opt, idx, targets) -> float:
    loss = model(idx, targets)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def _close(a: float, b: float, rtol: float) -> bool:
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= rtol * abs(b) + 1e-7


def _all_ranks_ok(ok: bool, device: torch.device) -> bool:
    flag = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(setup: Setup, args: argparse.Namespace) -> bool:
    """Train both models on the same per-rank batches; True when every loss matched."""
    from .models import synthetic_tokens

    cfg, compiled, eager = build_models(setup, args)
    opt_c = torch.optim.AdamW(compiled.parameters(), lr=1e-3)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    rtol = args.rtol or (1e-3 if setup.device.type == "cuda" else 1e-4)
    say = print if setup.rank == 0 else (lambda *a, **k: None)
    say(
        f"bucketwise demo: GPT {cfg.layers} layers, d_model {cfg.d_model}, {setup.world} ranks on "
        f"{setup.device.type}, backend {args.backend}, strategy {args.strategy}, "
        f"bucket cap {args.bucket_cap_mb} MiB, batch {BATCH_PER_RANK} per rank",
        flush=True,
    )
    ok = True
    for step in range(args.steps):
        idx, targets = synthetic_tokens(cfg, BATCH_PER_RANK, seed=1000 * step + setup.rank, device=setup.device)
        _sync(setup.device)
        start = time.perf_counter()
        loss_c = train_step(compiled, opt_c, idx, targets)
        _sync(setup.device)
        seconds = time.perf_counter() - start
        loss_e = train_step(eager, opt_e, idx, targets)
        match = _close(loss_c, loss_e, rtol)
        if not match:
            print(
                f"rank {setup.rank} step {step}: compiled loss {loss_c:.9g} != eager loss {loss_e:.9g} "
                f"(difference {abs(loss_c - loss_e):.3g}, rtol {rtol:g})",
                file=sys.stderr,
                flush=True,
            )
        ok = ok and match
        say(
            f"step {step}: loss compiled {loss_c:.6f}  eager {loss_e:.6f}  "
            f"{'ok' if match else 'MISMATCH'}  compiled step {seconds * 1000:.1f} ms",
            flush=True,
        )
    _summarize(setup, compiled)
    return _all_ranks_ok(ok, setup.device)


def _summarize(setup: Setup, compiled) -> None:
    import bucketwise

    report = bucketwise.report(compiled)
    report.write_rank_file()  # final state (alignment known now) for `bucketwise stats`
    if setup.rank != 0:
        return
    print("\nrank 0 report:")
    print(report.table())
    detail = report.alignment_detail()
    if detail.get("alignment") is not None:  # the table's last line already says why it is n/a
        print(_alignment_line(detail), flush=True)


def _alignment_line(detail: dict) -> str:
    if detail.get("alignment") is None:
        status = str(detail.get("status"))
        if status.startswith("pending"):
            status += "; DDP publishes them from the 3rd step on"
        return f"alignment n/a ({status})"
    buckets = detail.get("buckets") or []
    aligned = sum(1 for b in buckets if b["status"] == "aligned")
    return (
        f"alignment {detail['alignment']:.2f}: {aligned} of {len(buckets)} DDP buckets lie inside one "
        f"compiled segment ({detail.get('status')})"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bucketwise.launch.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_demo_arguments(parser)
    args = parser.parse_args(argv)
    setup = init_distributed()
    try:
        ok = train(setup, args)
    finally:
        dist.destroy_process_group()
    if not ok:
        if setup.rank == 0:
            print("bucketwise demo: FAILED: compiled losses differ from eager (see above)", file=sys.stderr)
        return 1
    if setup.rank == 0:
        print("bucketwise demo: compiled losses match eager on every rank and step", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
