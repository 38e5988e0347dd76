"""One zoo model on one rank: eager DDP, then each compiled config, from the same parameters.

``run_model(rank, world_size, name, opts)`` runs inside an initialised process group and
returns this rank's record: per config its status, the parameter check against eager DDP
(``zoo.check``), what ``bucketwise.report`` counted, and seconds. ``opts["mode"]`` is
``"check"`` (CPU: ``torch``, ``auto``, ``fused``, ``split`` against eager DDP) or ``"speed"``
(one GPU: step time and peak memory of ``local``, ``torch``, ``bw-fused``, ``bw-fused-cg``).
"""

from __future__ import annotations

import gc
import time
import traceback
from contextlib import nullcontext
from typing import Any, Callable

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import bucketwise
from bucketwise.benchmarks.core.names import ZOO_CHECK, ZOO_CHECK_ON_REQUEST, ZOO_SPEED, strategy_of
from bucketwise.benchmarks.zoo.check import compare, replica_spread, snapshot
from bucketwise.benchmarks.zoo.spec import Built, ZooModel, forward_kwargs

CHECK_CONFIGS = ZOO_CHECK
CHECKABLE_CONFIGS = (*ZOO_CHECK, *ZOO_CHECK_ON_REQUEST)
SPEED_CONFIGS = ZOO_SPEED
SEED = 0
LR = 0.05
BUCKETS = 6


def fresh(spec: ZooModel, device: torch.device, init: dict[str, torch.Tensor] | None) -> Built:
    torch.manual_seed(SEED)
    built = spec.build()
    built.module.to(device).train()
    if init is not None:
        built.module.load_state_dict(init)
    return built


def compiled_for(config: str, built: Built, spec: ZooModel, device: torch.device, backend: str) -> tuple[Any, Any]:
    """(what the training loop calls, the DDP module or ``None`` for ``local``)."""
    kw = dict(spec.compile_kwargs)
    if config == "eager":
        ddp = make_ddp(built, spec, device)
        return ddp, ddp
    if config == "local":
        return torch.compile(built.module, backend=backend, **kw), None
    if config == "torch":
        ddp = make_ddp(built, spec, device, min_cap_mb=TORCH_MIN_CAP_MB)
        return torch.compile(ddp, backend=backend, **kw), ddp
    ddp = make_ddp(built, spec, device)
    strategy = strategy_of(config)
    if strategy is None:
        raise ValueError(f"expected eager, local, torch or a bw- config, got {config!r}")
    variants = config.split("-")[2:]  # bw-<strategy>[-cg][-blocks]
    cudagraphs, share_blocks = "cg" in variants, True if "blocks" in variants else "auto"
    compiled = bucketwise.compile(
        ddp, backend=backend, strategy=strategy, cudagraphs=cudagraphs, share_blocks=share_blocks, **kw
    )
    return compiled, ddp


def make_ddp(built: Built, spec: ZooModel, device: torch.device, *, min_cap_mb: float = 0.0) -> DDP:
    ids = [device.index] if device.type == "cuda" else None
    return DDP(
        built.module,
        device_ids=ids,
        find_unused_parameters=spec.find_unused_parameters,
        bucket_cap_mb=max(bucket_cap_mb(built.module), min_cap_mb, spec.min_bucket_cap_mb),
    )


def bucket_cap_mb(module: torch.nn.Module) -> float:
    """About ``BUCKETS`` buckets whatever the model's size: the tiny models would otherwise fit
    one bucket, and ``split`` and ``fused`` would have nothing to cut or overlap."""
    size = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    return max(size / BUCKETS / 2**20, 1e-3)


TORCH_MIN_CAP_MB = 1.0
"""``torch.compile(DDP)``'s DDPOptimizer asserts that its 1 MiB first bucket is no larger than
DDP's cap, so the anchor runs with a cap of at least 1 MiB (bucket caps do not change what two
ranks compute)."""


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def train(
    call: Callable,
    built: Built,
    spec: ZooModel,
    rank: int,
    steps: range,
    device: torch.device,
    opt: torch.optim.Optimizer,
    perturb: bool = False,
) -> tuple[list[float], float | None]:
    losses, first = [], None
    t0 = time.perf_counter()
    for step in steps:
        for micro in range(spec.accumulate):
            sync = micro == spec.accumulate - 1
            batch = to_device(built.batch(rank, step * spec.accumulate + micro), device)
            with nullcontext() if sync else call.no_sync():
                with autocast(spec, device):
                    out = call(**forward_kwargs(batch))
                loss = built.loss(out, batch)
                loss.backward()
        if perturb:  # a wrong gradient, as a bug would leave it: the check must catch it
            perturb_gradient(built.module, 1.01)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if first is None:
            first = time.perf_counter() - t0
    return [x.item() for x in losses], first


def perturb_gradient(module: torch.nn.Module, factor: float) -> None:
    """Scale the first gradient by ``factor``: a wrong gradient, as a bug would leave it."""
    next(p for p in module.parameters() if p.grad is not None).grad.mul_(factor)


def autocast(spec: ZooModel, device: torch.device) -> Any:
    if spec.autocast is None:
        return nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, spec.autocast))


def report_fields(compiled: Any) -> dict[str, Any]:
    d = bucketwise.report(compiled).data()
    t = d.totals
    graphs = [g for g in d.graphs if g.variant is None]
    reasons = [s.reason for g in d.graphs for s in g.segments if s.fell_back]
    return {
        "graphs": t["graphs"],
        "graph_breaks": t["graph_breaks"],
        "recompiles": t["recompiles"],
        "segments": t["segments"],
        "fallbacks": t["fallbacks"],
        "compile_s": round(t["compile_seconds"], 3),
        "eager_calls": t["eager_calls"],
        "strategies": sorted({g.strategy for g in graphs}),
        "strategy_reasons": sorted({g.strategy_reason for g in graphs if g.strategy_reason}),
        "fallback_reasons": sorted({(r or "")[:300] for r in reasons}),
        "break_reasons": sorted({r[:200] for g in graphs for r in g.graph_break_reasons})[:5],
        "shared_blocks": [g.shared_blocks for g in graphs if g.shared_blocks],
    }


def check_config(
    config: str, spec: ZooModel, rank: int, opts: dict[str, Any], init: dict, init_snap: dict, eager: dict
) -> dict[str, Any]:
    device = torch.device(opts["device"])
    built = fresh(spec, device, init)
    t0 = time.perf_counter()
    call, ddp = compiled_for(config, built, spec, device, opts["backend"])
    opt = torch.optim.SGD(built.module.parameters(), lr=LR)
    losses, first = train(
        call, built, spec, rank, range(opts["steps"]), device, opt, perturb=opts.get("perturb") == config
    )
    rec: dict[str, Any] = {
        "config": config,
        "seconds": round(time.perf_counter() - t0, 2),
        "losses": losses,
        "first_step_s": round(first, 3),
    }
    rec["check"] = compare(init_snap, eager, snapshot(built.module))
    rec["replica_spread"] = replica_spread(built.module)
    if config != "torch":
        rec.update(report_fields(call))
    rec["status"] = status_of(rec)
    return rec


def status_of(rec: dict[str, Any]) -> str:
    if not rec["check"]["ok"] or rec["replica_spread"] != 0.0:
        return "mismatch"
    if rec.get("fallbacks") or rec.get("eager_calls"):
        return "fallback"
    return "pass"


def error_record(config: str, exc: BaseException) -> dict[str, Any]:
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    return {
        "config": config,
        "status": "error",
        "error": f"{type(exc).__name__}: {lines[0] if lines else ''}"[:400],
        "traceback": traceback.format_exc()[-4000:],
    }


def warm_up(backend: str, device: torch.device) -> None:
    """Compile a tiny function once, so the compiler's one-time start-up is not charged to the
    first config."""
    x = torch.ones(4, device=device, requires_grad=True)
    torch.compile(lambda t: (t * 2).sum(), backend=backend)(x).backward()
    torch.compiler.reset()


def run_check(spec: ZooModel, rank: int, opts: dict[str, Any]) -> list[dict[str, Any]]:
    device = torch.device(opts["device"])
    built = fresh(spec, device, None)
    init = {k: v.detach().clone() for k, v in built.module.state_dict().items()}
    init_snap = snapshot(built.module)
    call, _ = compiled_for("eager", built, spec, device, opts["backend"])
    opt = torch.optim.SGD(built.module.parameters(), lr=LR)
    warm_up(opts["backend"], device)
    t0 = time.perf_counter()
    losses, first = train(call, built, spec, rank, range(opts["steps"]), device, opt)
    records = [
        {
            "config": "eager",
            "status": "pass",
            "seconds": round(time.perf_counter() - t0, 2),
            "losses": losses,
            "first_step_s": round(first, 3),
            "bucket_cap_mb": bucket_cap_mb(built.module),
            "params": sum(p.numel() for p in built.module.parameters()),
            "trainable": sum(p.numel() for p in built.module.parameters() if p.requires_grad),
        }
    ]
    eager = snapshot(built.module)
    del call, built, opt
    for config in opts.get("configs") or CHECK_CONFIGS:
        torch.compiler.reset()
        try:
            rec = check_config(config, spec, rank, opts, init, init_snap, eager)
        except Exception as exc:  # noqa: BLE001 - recorded; the other configs go on
            rec = error_record(config, exc)
        records.append(rec)
        gc.collect()
    return records
