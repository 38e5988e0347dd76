"""One zoo model on one GPU: step time and peak memory of each config (``zoo.py --device cuda``).

Per config: a fresh model from the same parameters, ``WARMUP`` steps (the first compiles and is
timed alone: ``first_step_s``), then ``opts["steps"]`` steps timed with CUDA events (median and
minimum ms), and ``torch.cuda.max_memory_allocated`` over all of them (reset before the config).
Eager DDP runs first as the reference.

NOTE [checking a config step by step]: after the timed steps each config trains
``CHECK_STEPS`` more, and before each of them an eager DDP twin is loaded with the config's own
parameters and buffers and trains the same step: the two updates must agree (``zoo.check``, at
ten times the CPU tolerance: Inductor fuses and reorders float math). The check so covers the
steps that replay CUDA graphs. Comparing the final parameters with eager DDP's after all the
steps (``check``, kept in the record) does not work on GPU: Inductor's round-off grows from
step to step, and in BatchNorm conv nets by about 1e4 in two steps, so that ``local`` (the model
compiled without DDP) already differs from eager by more than its updates. Even one step of such
a net on GPU can miss the fp32 tolerance with every compiled config, ``local`` included: a
float64 twin trains the same step too, and a step also passes when the config's distance from
the float64 update is within a few times eager fp32's own (``zoo.check.against_fp64``, the
yardstick torch's own benchmark accuracy checks use). Convolutions run
in fp32 (cuDNN's TF32 off, as matmuls are by default): with TF32 a convolution rounds to about
1e-3, which one step of a BatchNorm conv net amplifies past any useful tolerance.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from typing import Any

import torch

import bucketwise
from bucketwise.benchmarks.zoo.check import against_fp64, compare, snapshot
from bucketwise.benchmarks.zoo.spec import Built, ZooModel, forward_kwargs
from bucketwise.benchmarks.zoo.train import (
    LR,
    SPEED_CONFIGS,
    compiled_for,
    error_record,
    fresh,
    perturb_gradient,
    report_fields,
    to_device,
    warm_up,
)

WARMUP = 3
CHECK_STEPS = 3
GPU_RTOL_SCALE = 10.0


PERTURB = 1.05
"""``opts["perturb"]`` names a config whose first gradient is scaled by this (5% off, five times
the GPU tolerance), as a bug would leave it: ``tests/benchmarks/test_zoo.py`` checks the step check sees it."""


def step_fn(
    call: Any, built: Built, batches: list[dict[str, Any]], opt: torch.optim.Optimizer, *, perturb: bool = False
):
    def step(i: int) -> torch.Tensor:
        batch = batches[i]
        loss = built.loss(call(**forward_kwargs(batch)), batch)
        loss.backward()
        if perturb:
            perturb_gradient(built.module, PERTURB)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def device_of(opts: dict[str, Any]) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if opts["device"] == "cuda" else torch.device("cpu")


def timed(
    config: str, spec: ZooModel, rank: int, opts: dict[str, Any], init: dict
) -> tuple[dict[str, Any], Built, Any, Any]:
    """On CUDA with events and peak memory; on CPU (a dry run of this path) with the host clock."""
    device = device_of(opts)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    built = fresh(spec, device, init)
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    call, _ = compiled_for(config, built, spec, device, opts["backend"])
    opt = torch.optim.SGD(built.module.parameters(), lr=LR)
    steps = opts["steps"]
    batches = [to_device(built.batch_for(device)(rank, i), device) for i in range(WARMUP + steps + CHECK_STEPS)]
    step = step_fn(call, built, batches, opt, perturb=opts.get("perturb") == config)
    t0 = time.perf_counter()
    step(0)
    sync()
    first = time.perf_counter() - t0
    for i in range(1, WARMUP):
        step(i)
    ms = timed_steps(step, range(WARMUP, WARMUP + steps), cuda)
    peak = round(torch.cuda.max_memory_allocated() / 2**20, 1) if cuda else None
    rec = {
        "config": config,
        "status": "pass",
        "first_step_s": round(first, 3),
        "median_ms": round(statistics.median(ms), 3),
        "min_ms": round(min(ms), 3),
        "peak_mib": peak,
    }
    return rec, built, call, step


def timed_steps(step: Any, indices: range, cuda: bool) -> list[float]:
    if not cuda:
        ms = []
        for i in indices:
            t0 = time.perf_counter()
            step(i)
            ms.append((time.perf_counter() - t0) * 1e3)
        return ms
    events = [torch.cuda.Event(enable_timing=True) for _ in range(len(indices) + 1)]
    events[0].record()
    for k, i in enumerate(indices):
        step(i)
        events[k + 1].record()
    torch.cuda.synchronize()
    return [events[k].elapsed_time(events[k + 1]) for k in range(len(indices))]


CONV_TF32 = False
"""cuDNN's TF32 in the speed runs (NOTE [checking a config step by step]); ``zoo.py`` writes it
into the run's header."""


@contextlib.contextmanager
def fp32_convolutions() -> Any:
    """cuDNN's TF32 set to ``CONV_TF32`` within; restored on leaving."""
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = CONV_TF32
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32 = saved


def run_speed(spec: ZooModel, rank: int, opts: dict[str, Any]) -> list[dict[str, Any]]:
    with fp32_convolutions():
        return _run_speed(spec, rank, opts)


def _run_speed(spec: ZooModel, rank: int, opts: dict[str, Any]) -> list[dict[str, Any]]:
    warm_up(opts["backend"], device_of(opts))
    init_built = fresh(spec, device_of(opts), None)
    init = {k: v.detach().clone() for k, v in init_built.module.state_dict().items()}
    init_snap = snapshot(init_built.module)
    params = sum(p.numel() for p in init_built.module.parameters())
    del init_built
    records, eager = [], None
    for config in ("eager", *(opts.get("configs") or SPEED_CONFIGS)):
        torch.compiler.reset()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        try:
            rec, built, call, step = timed(config, spec, rank, opts, init)
            state = snapshot(built.module)
            if config == "eager":
                eager, rec["params"] = state, params
            else:
                rec["check"] = compare(init_snap, eager, state, rtol_scale=GPU_RTOL_SCALE)
                rec["step_check"] = step_check(config, spec, rank, opts, built, step)
                rec["status"] = "pass" if rec["step_check"]["ok"] else "mismatch"
            if config.startswith("bw-"):
                rec.update(report_fields(call))
                rec["cuda_graphs"] = cuda_graph_fields(call)
                if rec.get("fallbacks") or rec.get("eager_calls"):
                    rec["status"] = "fallback" if rec["status"] == "pass" else rec["status"]
            del built, call
        except Exception as exc:  # noqa: BLE001 - recorded; the other configs go on
            rec = error_record(config, exc)
        records.append(rec)
    return records


def step_check(config: str, spec: ZooModel, rank: int, opts: dict[str, Any], built: Built, step: Any) -> dict[str, Any]:
    """The worst of ``CHECK_STEPS`` steps, each against eager twins started from the config's own
    state (``step`` names the worst one; NOTE [checking a config step by step]): one in fp32
    (``zoo.check.compare``) and one in float64 (``zoo.check.against_fp64``, recorded as ``fp64``).
    A step passes when either check passes. Every rank runs both twins every step: their DDP
    steps are collectives."""
    first = WARMUP + opts["steps"]
    twin, twin_step = _twin(config, spec, rank, opts, exact=False)
    exact, exact_step = _twin(config, spec, rank, opts, exact=True)
    worst: dict[str, Any] = {}
    start = snapshot(built.module)
    for i in range(first, first + CHECK_STEPS):
        twin.module.load_state_dict(built.module.state_dict())  # copies, before the config steps
        exact.module.load_state_dict(built.module.state_dict())  # copied in as float64
        step(i)
        twin_step(i)
        exact_step(i)
        eager, compiled = snapshot(twin.module), snapshot(built.module)
        res = compare(start, eager, compiled, rtol_scale=GPU_RTOL_SCALE)
        res["fp64"] = against_fp64(start, eager, compiled, snapshot(exact.module))
        res["ok"] = res["ok"] or res["fp64"]["ok"]
        if not worst or _severity(res) > _severity(worst):
            worst = {**res, "step": i}
        start = compiled
    return worst


def _severity(res: dict[str, Any]) -> tuple[bool, float]:
    """Failing before passing, then by the smaller of the two ratios (the one that decides)."""
    return (not res["ok"], min(res["ratio"], res["fp64"]["ratio"]))


def _twin(config: str, spec: ZooModel, rank: int, opts: dict[str, Any], *, exact: bool) -> tuple[Built, Any]:
    """An eager copy of the model (``exact``: in float64, fed float64 inputs) and its training
    step: under DDP, or for ``local`` the model alone (which averages nothing over several ranks)."""
    device = device_of(opts)
    twin = fresh(spec, device, None)
    if exact:
        twin.module.double()
    call = twin.module if config == "local" else compiled_for("eager", twin, spec, device, opts["backend"])[0]
    batches = []
    for i in range(WARMUP + opts["steps"] + CHECK_STEPS):
        batch = to_device(twin.batch_for(device)(rank, i), device)
        batches.append({k: _double(v) for k, v in batch.items()} if exact else batch)
    return twin, step_fn(call, twin, batches, torch.optim.SGD(twin.module.parameters(), lr=LR))


def _double(value: Any) -> Any:
    return value.double() if isinstance(value, torch.Tensor) and value.is_floating_point() else value


def cuda_graph_fields(call: Any) -> dict[str, int] | None:
    graphs = bucketwise.report(call).to_dict()["cudagraphs"]
    if not graphs:
        return None
    return {
        "graphs": len(graphs),
        "captured": sum(1 for g in graphs if g["captured"]),
        "replays": sum(g["replays"] for g in graphs),
        "uncaptured_runs": sum(g["uncaptured_runs"] for g in graphs),
        "not_captured": {g["name"]: g["reason"] for g in graphs if not g["captured"]},
    }
