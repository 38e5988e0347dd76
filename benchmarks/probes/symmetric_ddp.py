"""Whether NCCL's symmetric kernels make the overlap cheaper in a real backward, before bucketwise
builds on them: eager DDP on a harness model, its gradients all-reduced three ways, against the
same model without DDP, in interleaved rounds.

    NCCL_WIN_ENABLE=1 torchrun --standalone --nproc-per-node 4 -m bucketwise.benchmarks \\
        probe symmetric_ddp --model gpt-medium --batch 8 --out DIR

Configs (each its own model copy, seed 0, fused AdamW, the harness's step):

- ``local``: the model alone, no DDP: the floor;
- ``ddp``: eager DDP as built (its C++ reducer divides each bucket by the world size, then
  NCCL sums it over ordinary memory, ring kernels);
- ``ddp-copy``: a comm hook that divides each bucket into a persistent buffer of its own, sums
  it there and copies it back: ``ddp-symm``'s copies, over ordinary memory (what the copies
  cost);
- ``ddp-symm``: the same hook over buffers NCCL registered as symmetric windows
  (``_compat.collectives.symmetric_buffers``; NCCL >= 2.27 then runs its symmetric kernels,
  which take fewer SMs: ``results/2026-11-28_4xH200_comm-overlap-symmetric-windows``);
- ``ddp-pool``: no hook, no copies: DDP's own buckets allocated in a pool of the NCCL allocator
  registered as symmetric windows (the step during which DDP rebuilds its buckets, the second,
  runs with that pool as its allocator; the pool is registered after it), so DDP's reducer sums
  its buckets in place with the symmetric kernels;
- ``bw-split``, ``bw-split-pool``: ``bucketwise.compile(DDP(model), strategy="split")`` (DDP's
  reducer all-reduces the compiled backward's gradients in its buckets), without and with its
  buckets in the registered pool as in ``ddp-pool``;
- ``bw-auto``: ``bucketwise.compile(DDP(model))``, for reference;
- ``local-compiled``: ``torch.compile(model)``, no DDP: the floor of the ``bw-`` configs.

The pool configs' second step allocates everything it allocates on the issuing thread in the pool
(the forward's activations too), memory the other steps do not reuse: their peak memory is higher
by that much.

The hooks' buffers are allocated after two steps, once DDP has rebuilt its buckets in the order
the gradients came; until then the hooks reduce as ``ddp`` does. After the timed rounds every
config's parameters are compared with ``ddp``'s: ``ddp-copy`` does the same arithmetic (equal
bits expected), ``ddp-symm`` sums in another order (a small difference expected). Without CUDA
(gloo, a CPU smoke run) ``ddp-symm`` is left out.

``results.json`` (rank 0): per config and round the slowest rank's median step (CUDA events)
and the process's CPU time (NOTE [a step's CPU time]), peak memory, and the parameter check.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from bucketwise._compat import collectives as cc
from bucketwise.benchmarks.core import metrics as bm
from bucketwise.benchmarks.core.configs import Recipe, recipe_for
from bucketwise.benchmarks.core.meta import run_meta
from bucketwise.benchmarks.core.models import MODELS, make_spec
from bucketwise.benchmarks.core.step import training_step

CONFIGS = ("local", "local-compiled", "ddp", "ddp-copy", "ddp-symm", "ddp-pool", "bw-split", "bw-split-pool", "bw-auto")
POOLED = ("ddp-pool", "bw-split-pool")
"""Configs whose DDP buckets are allocated in a registered symmetric pool (NCCL only)."""
WARMUP = 3
"""Steps before the rounds; the hooks' buffers are allocated after the second."""


@dataclasses.dataclass
class BufferedReduce:
    """Comm hook state: one persistent buffer per DDP bucket, allocated by :meth:`allocate`."""

    group: Any
    world: int
    symmetric: bool
    numels: dict[int, int] = dataclasses.field(default_factory=dict)
    """Bucket index -> elements, as the last step's buckets had them."""
    buffers: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)

    def allocate(self, device: torch.device) -> None:
        """One buffer per bucket seen (every rank the same sizes, in bucket order: a collective
        call when symmetric)."""
        order = sorted(self.numels)
        sizes = [self.numels[i] for i in order]
        if self.symmetric:
            made = cc.symmetric_buffers(self.group, sizes, device)
        else:
            made = [torch.empty(n, device=device) for n in sizes]
        self.buffers = dict(zip(order, made))


def buffered_hook(state, bucket):  # type: ignore[no-untyped-def]
    """Divide the bucket by the world size into its persistent buffer (DDP's own ``div_``, so
    the same bits), sum that buffer in place, copy it back into the bucket. (Not annotated: DDP
    compares a hook's annotations with its own types, and this module's are strings.)"""
    flat = bucket.buffer()
    index = bucket.index()
    into = state.buffers.get(index)
    # Until the buffers exist, and for a bucket that is not fp32 (the symmetric pool's buffers
    # are): DDP's own reduction.
    if into is None or into.numel() != flat.numel() or into.dtype != flat.dtype:
        state.numels[index] = flat.numel()
        flat.div_(state.world)
        work = dist.all_reduce(flat, group=state.group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])
    torch.div(flat, state.world, out=into)
    work = dist.all_reduce(into, group=state.group, async_op=True)

    def back(fut: torch.futures.Future) -> torch.Tensor:
        flat.copy_(into)
        return flat

    return work.get_future().then(back)


def _recipe(config: str) -> Recipe:
    """The harness recipe a config's model is built and stepped with (its hooks and pool aside)."""
    if config.startswith("bw-"):
        return recipe_for(config.removesuffix("-pool"))
    if config == "local-compiled":
        return recipe_for("local")
    return Recipe(ddp=config != "local")  # eager, with or without DDP


def _build(config: str, spec: Any, device: torch.device) -> dict[str, Any]:
    model, prepared, _, step = training_step(_recipe(config), spec, device, "inductor", isolated=True)
    state = None
    if config in ("ddp-copy", "ddp-symm"):
        state = BufferedReduce(group=dist.group.WORLD, world=dist.get_world_size(), symmetric=config == "ddp-symm")
        prepared.module.register_comm_hook(state, buffered_hook)
    pool = cc.symmetric_pool(dist.group.WORLD, device) if config in POOLED else None
    for i in range(WARMUP):
        if pool is not None and i == 1:
            # DDP rebuilds its buckets in this step's forward, on this thread.
            with torch.cuda.use_mem_pool(pool):
                step()
            _sync(device)
            cc.register_symmetric(dist.group.WORLD, device, pool)
            continue
        step()
        if state is not None and i == 1:
            _sync(device)
            state.allocate(device)
    return {"config": config, "model": model, "step": step, "step_ms": [], "process_cpu_ms": [], "peak_mib": 0.0}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(entry: dict[str, Any], steps: int, device: torch.device) -> None:
    """``steps`` steps: the slowest rank's time per step, the median CPU time of the process (NOTE
    [a step's CPU time])."""
    step: Callable[[], None] = entry["step"]
    dist.barrier()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    cpu = []
    for _ in range(steps):
        c = bm.process_cpu_s()
        step()
        cpu.append((bm.process_cpu_s() - c) * 1e3)
    _sync(device)
    ms = (time.perf_counter() - start) * 1e3 / steps
    slowest = torch.tensor([ms], device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    entry["step_ms"].append(slowest.item())
    entry["process_cpu_ms"].append(statistics.median(cpu))
    if device.type == "cuda":
        entry["peak_mib"] = max(entry["peak_mib"], torch.cuda.max_memory_allocated(device) / 2**20)


def _max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(
        (x.detach().float() - y.detach().float()).abs().max().item() for x, y in zip(a.parameters(), b.parameters())
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-medium", choices=MODELS)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--configs", default="local,ddp,ddp-copy,ddp-symm", help=f"from {CONFIGS}")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed steps per config per round")
    p.add_argument("--out", default=None, help="folder for results.json (rank 0)")
    args = p.parse_args(argv)
    configs = args.configs.split(",")
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or "ddp" not in configs:
        p.error(f"--configs: expected names from {CONFIGS}, ddp among them, got {args.configs!r}")
    if "RANK" not in os.environ:
        p.error("run under torchrun")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))
        torch.set_float32_matmul_precision("high")
        device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
        configs = [c for c in configs if c != "ddp-symm" and c not in POOLED]  # NCCL's symmetric windows only
    rank = dist.get_rank()
    sizes = {k: v for k, v in (("layers", args.layers), ("batch", args.batch)) if v is not None}
    spec = make_spec(args.model, sizes)
    entries = {c: _build(c, spec, device) for c in configs}
    for rnd in range(args.rounds):
        for c in configs if rnd % 2 == 0 else configs[::-1]:
            _timed(entries[c], args.steps, device)
        if rank == 0:
            print(f"round {rnd + 1}: " + ", ".join(f"{c} {entries[c]['step_ms'][-1]:.2f}" for c in configs), flush=True)
    rows = []
    for c, e in entries.items():
        row = {k: e[k] for k in ("config", "step_ms", "process_cpu_ms", "peak_mib")}
        row["step_ms_median"] = statistics.median(e["step_ms"])
        row["process_cpu_ms_median"] = statistics.median(e["process_cpu_ms"])
        floor = "local-compiled" if c.startswith("bw-") or c == "local-compiled" else "local"
        base = entries[floor]["step_ms"] if floor in entries else None
        if base:
            row["step_ratio"] = statistics.median(a / b for a, b in zip(e["step_ms"], base))
        if not c.startswith("local"):
            row["max_param_diff_vs_ddp"] = _max_diff(e["model"], entries["ddp"]["model"])
        rows.append(row)
    if rank == 0:
        for r in rows:
            print(
                f"{r['config']}: step {r['step_ms_median']:.2f} ms (x floor {r.get('step_ratio', float('nan')):.3f}), "
                f"CPU {r['process_cpu_ms_median']:.2f} ms, peak {r['peak_mib']:,.0f} MiB, "
                f"params vs ddp {r.get('max_param_diff_vs_ddp', '-')}",
                flush=True,
            )
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            meta = {**run_meta(), "model": spec.describe(), "world_size": dist.get_world_size(), "rounds": args.rounds}
            meta.update(steps=args.steps, nccl=list(torch.cuda.nccl.version()) if cuda else None)
            with open(os.path.join(args.out, "results.json"), "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
