"""Every comm hook of ``torch.distributed.algorithms.ddp_comm_hooks`` trains like eager DDP with
the same hook under bucketwise, on one GPU: ``pytest tests/gpu/test_gpu_comm_hooks.py -m gpu``.

Per hook (``HOOKS``) and config (``CONFIGS``): a small GPT (fp32, TF32 off) under eager DDP with
the hook is the reference, next to ``bucketwise.compile`` of a copy with the same hook and a state
of its own. Each step both start from eager's parameters (copied in place: CUDA graphs read
parameters at their addresses), and every gradient is compared as ``|g - g_eager| / |g_eager|``
(float64) against the hook's bound; a second eager DDP copy says, when one is off, whether eager
DDP reproduced itself (torch's ``powerSGD_hook`` did not: see ``_synced``). Where bucketwise
does not run a config as asked it must say so as docs/comm-hooks.md states: a hook it cannot
trace runs ``split`` under ``auto``, the reason in the report, and ``strategy="fused"`` refuses
it with a ``ValueError``. torch's ``batched_powerSGD_hook`` fails at its first compressed step in
eager DDP too; the compiled copy must then fail the same way at the same step.

One GPU, NCCL, world size 1: DDP still calls the hook and bucketwise still traces the
collectives. Each hook runs in a spawned process of its own (all on cuda:0, all at once), its
configs one after the other: the Inductor compiles take most of the time.
"""

from __future__ import annotations

import copy
import dataclasses
import faulthandler
import gc
import json
import math
import traceback
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from support.gpu_ranks import run_ranks, world_of_one
from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks, default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
from torch.nn.parallel import DistributedDataParallel as DDP

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _untraced(name: str) -> str:
    return (
        f"comm hook {name} cannot be traced into the graph (wrap a hook written with functional collectives in "
        "bucketwise.traceable_comm_hook)"
    )


def _powersgd() -> ps.PowerSGDState:
    return ps.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2)


def _synced(hook: Callable) -> Callable:
    """``hook`` followed by a device synchronize. torch's ``powerSGD_hook`` on CUDA runs its future
    callbacks on side streams and drops tensors they still read (its error-feedback copy) back to
    the caching allocator, so the next bucket's hook can overwrite them, intermittently, in eager
    DDP and in ``split`` (whose reducer runs the same hook): docs/comm-hooks.md. With the hook's
    work finished before DDP goes on, eager DDP is a reference that reproduces itself."""

    def synced_hook(state, bucket):  # unannotated: DDP checks annotations, and these would be strings
        fut = hook(state, bucket)
        torch.cuda.synchronize()
        return fut

    return synced_hook


@dataclasses.dataclass(frozen=True)
class Hook:
    make: Callable[[], tuple[Any, Callable]]
    """A new (state, hook) for each DDP module."""
    bound: float
    """The largest distance of a gradient from eager DDP's."""
    wire: torch.dtype | None = None
    """The dtype on the wire: at world size 1 every reduced gradient is exactly one of its values."""
    untraceable: str | None = None
    """Why the fused strategy cannot reproduce the hook, as bucketwise words it; ``None``: it does."""
    racy: bool = False
    """Wherever DDP's reducer calls the hook (eager DDP, ``split``), it is called through
    :func:`_synced`; bucketwise's own program for it is not."""


FP32 = 1e-5  # no rounding of the gradients: only Inductor's own round-off
# The compressing hooks round both runs' gradients to the wire dtype, so an element whose fp32
# inputs differ by round-off may land one ulp apart: the bound is one ulp (2^-10 fp16, 2^-7 bf16),
# which a distance over a whole gradient reaches only if every element flipped. Skipping the
# rounding would stay below it: ``Hook.wire`` checks that it happened.
FP16, BF16 = 1e-3, 1e-2
# PowerSGD's rank-4 approximation passes the round-off on through its orthogonalisation (both
# states draw the same random Q): tests/distributed/test_powersgd.py holds Inductor's gradients
# to rtol 1e-4, element by element.
POWERSGD = 1e-4
HOOKS = {
    "fp16": Hook(lambda: (None, default_hooks.fp16_compress_hook), FP16, torch.float16),
    "bf16": Hook(lambda: (None, default_hooks.bf16_compress_hook), BF16, torch.bfloat16),
    "fp16-wrapper": Hook(
        lambda: (None, default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook)),
        FP16,
        torch.float16,
        _untraced("fp16_compress_wrapper.<locals>.fp16_compress_wrapper_hook"),
    ),
    "bf16-wrapper": Hook(
        lambda: (None, default_hooks.bf16_compress_wrapper(default_hooks.allreduce_hook)),
        BF16,
        torch.bfloat16,
        _untraced("bf16_compress_wrapper.<locals>.bf16_compress_wrapper_hook"),
    ),
    "powerSGD": Hook(lambda: (_powersgd(), ps.powerSGD_hook), POWERSGD, racy=True),
    "batched-powerSGD": Hook(
        lambda: (_powersgd(), ps.batched_powerSGD_hook),
        POWERSGD,
        untraceable=f"torch {torch.__version__}'s batched_powerSGD_hook fails at its first compressed step (its "
        "_orthogonalize takes only 3-D batches, the hook passes a 2-D matrix)",
    ),
    # World size 1: the unreduced gradients are the reduced ones.
    "noop": Hook(lambda: (None, debugging_hooks.noop_hook), FP32, untraceable=_untraced("noop_hook")),
}
CONFIGS = {
    "default": {},
    "fused": {"strategy": "fused"},
    "split": {"strategy": "split"},
    "fused-cg": {"strategy": "fused", "cudagraphs": True},
}
STEPS = 5  # PowerSGD compresses from step 2; CUDA graphs warm up, record, then replay
CAP_MB = 0.05  # several buckets of DDP's own
LR = 0.1
TIMEOUT = 420


def train(hook: str, config: str, device: torch.device, backend: str = "inductor") -> dict:
    """Eager DDP and ``bucketwise.compile`` with ``HOOKS[hook]`` under ``CONFIGS[config]``, side by
    side for ``STEPS`` steps; ``{"refused": message}`` where ``bucketwise.compile`` raised, else the
    worst gradient distance, a step where either copy failed, and what the report says."""
    import bucketwise
    from bucketwise.launch.models import GPT, GPTConfig, synthetic_tokens

    cfg = GPTConfig(vocab=512, seq=64, layers=2, d_model=64, heads=4)
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    ids = [device.index] if device.type == "cuda" else None
    # ``again``: a second eager DDP run, so that a mismatch says whether eager DDP reproduces itself.
    eager, again, ddp = (
        DDP(m, device_ids=ids, bucket_cap_mb=CAP_MB) for m in (model, copy.deepcopy(model), copy.deepcopy(model))
    )
    reducer_runs_it = {eager, again} | ({ddp} if CONFIGS[config].get("strategy") == "split" else set())
    for m in (eager, again, ddp):
        state, fn = HOOKS[hook].make()
        m.register_comm_hook(state, _synced(fn) if HOOKS[hook].racy and m in reducer_runs_it else fn)
    try:
        compiled = bucketwise.compile(ddp, backend=backend, **CONFIGS[config])
    except ValueError as exc:
        return {"refused": str(exc)}
    opt = torch.optim.SGD(eager.parameters(), lr=LR)
    wire = HOOKS[hook].wire
    out: dict[str, Any] = {"rel": -1.0, "step": -1, "param": "", "failed": None, "off_wire": [], "eager_rel": 0.0}
    for step in range(STEPS):
        x, y = synthetic_tokens(cfg, 4, seed=step, device=device)
        failed = {"eager": _backward(eager, x, y), "compiled": _backward(compiled, x, y)}
        if any(failed.values()):
            out["failed"] = {"step": step, **failed}
            break
        _backward(again, x, y)
        for p, a in zip(eager.parameters(), again.parameters(), strict=True):
            out["eager_rel"] = max(out["eager_rel"], _rel(p.grad, a.grad))
        for (name, p), q in zip(eager.module.named_parameters(), ddp.module.parameters(), strict=True):
            rel = _rel(p.grad, q.grad)
            if not rel <= out["rel"]:
                out.update(rel=rel, step=step, param=name)
            if wire is not None and q.grad is not None and not torch.equal(q.grad, q.grad.to(wire).to(q.grad.dtype)):
                out["off_wire"].append(f"{name} at step {step}")
        opt.step()
        with torch.no_grad():  # in place: CUDA graphs read parameters at their addresses
            for p, a, q in zip(eager.parameters(), again.parameters(), ddp.parameters(), strict=True):
                a.copy_(p)
                q.copy_(p)
        for m in (eager, again, ddp):
            m.zero_grad(set_to_none=True)
    rep = bucketwise.report(compiled).to_dict()
    out["graphs"] = sorted(
        {(g["strategy"], g["strategy_reason"]) for g in rep["graphs"] if g["variant"] is None}, key=str
    )
    out["replays"] = sum(c["replays"] for c in rep["cudagraphs"])
    out["not_replayed"] = [c["reason"] for c in rep["cudagraphs"] if c["reason"]]
    out["not_replayed"] += [n for n in rep["notes"] if n.startswith("cudagraphs=")]
    return out


def _backward(model: Any, x: torch.Tensor, y: torch.Tensor) -> str | None:
    """The error of a forward and backward (its type, where it was raised, its first line),
    ``None`` where it ran."""
    try:
        model(x, y).backward()
    except Exception as exc:  # noqa: BLE001 - compared between eager DDP and bucketwise
        where = traceback.extract_tb(exc.__traceback__)[-1].name
        return f"{type(exc).__name__} in {where}: {(str(exc).splitlines() or [''])[0]}"
    return None


def _rel(ref: torch.Tensor | None, got: torch.Tensor | None) -> float:
    """``|got - ref| / |ref|`` in float64 (the absolute norm where ``ref`` is zero); a gradient
    missing on one side only is infinitely far."""
    if ref is None or got is None:
        return 0.0 if ref is got else math.inf
    diff, scale = (got.double() - ref.double()).norm().item(), ref.double().norm().item()
    rel = diff / scale if scale > 0 else diff
    return math.inf if math.isnan(rel) else rel


def _worker(
    rank: int, world: int, store: str, hooks: list[str], out_dir: str, device: str, backend: str, errors
) -> None:
    """``hooks[rank]`` under every config (those without CUDA graphs off the GPU), in a one-rank
    process group of its own."""
    hook = hooks[rank]
    try:
        faulthandler.dump_traceback_later(TIMEOUT - 30, exit=True)
        dev = torch.device(device)
        world_of_one(f"{store}-{hook}", dev)
        results = {}
        for config in [c for c in CONFIGS if dev.type == "cuda" or not CONFIGS[c].get("cudagraphs")]:
            with torch._inductor.config.patch(compile_threads=2):  # seven processes compile at once
                results[config] = train(hook, config, dev, backend)
            torch.compiler.reset()
            gc.collect()
        Path(out_dir, f"{hook}.json").write_text(json.dumps(results))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        errors.put(f"{hook}: {traceback.format_exc()}")


def expected(hook: str, config: str) -> dict:
    """What docs/comm-hooks.md says bucketwise does: the refusal message, or the strategy of every
    graph and the reason the report gives."""
    why = HOOKS[hook].untraceable
    asked = CONFIGS[config].get("strategy", "auto")
    if why is None:
        return {"graphs": [("split" if asked == "split" else "fused", None)]}
    reason = f"{why}; DDP's reducer runs it, overlapping each bucket's hook with the backward"
    if asked == "fused":
        return {
            "refused": f"strategy='fused' cannot apply to DDP(GPT): {reason}. Pass strategy='auto', which runs "
            "'split' here (the report's strategy_reason says why), or strategy='split'"
        }
    return {"graphs": [("split", reason if asked == "auto" else None)]}


def failures(hook: str, config: str, r: dict) -> list[str]:
    """How ``r`` (:func:`train`'s result) departs from eager DDP or from :func:`expected`."""
    want, at = expected(hook, config), f"{hook} {config}"
    if "refused" in want or "refused" in r:
        return [] if r.get("refused") == want.get("refused") else [f"{at}: refused {r.get('refused')!r}, not {want}"]
    out = []
    if [tuple(g) for g in r["graphs"]] != want["graphs"]:
        out.append(f"{at}: graphs {r['graphs']}, expected {want['graphs']}")
    failed = r["failed"]
    if failed and not (failed["eager"] and failed["compiled"] == failed["eager"]):
        out.append(
            f"{at}: at step {failed['step']} eager DDP raised {failed['eager']}, bucketwise {failed['compiled']}"
        )
    if not r["rel"] <= HOOKS[hook].bound:
        out.append(
            f"{at}: the gradient of {r['param']} at step {r['step']} is {r['rel']:.3g} from eager DDP's (a second "
            f"eager DDP run was at most {r['eager_rel']:.3g} from the first)"
        )
    if r["off_wire"]:
        out.append(f"{at}: gradients not rounded to {HOOKS[hook].wire}: {r['off_wire'][:3]}")
    if CONFIGS[config].get("cudagraphs") and not (r["replays"] > 0 or r["not_replayed"]):
        out.append(f"{at}: no CUDA graph replayed and the report does not say why")
    return out


def table(results: dict) -> str:
    rows = [
        f"{'hook':<18}{'config':<10}{'outcome':<28}{'worst rel':>10}  step  {'replays':>7}  "
        f"{'eager/eager':>11}  parameter"
    ]
    for hook, configs in results.items():
        for config, r in configs.items():
            if "refused" in r:
                rows.append(f"{hook:<18}{config:<10}refused")
                continue
            outcome = "/".join(sorted({g[0] for g in r["graphs"]}))
            if r["failed"]:
                outcome += f", raises at step {r['failed']['step']}"
            rows.append(
                f"{hook:<18}{config:<10}{outcome:<28}{r['rel']:>10.3g}  {r['step']:>4}  {r['replays']:>7}  "
                f"{r['eager_rel']:>11.3g}  {r['param']}"
            )
    return "\n".join(rows)


def test_comm_hooks_match_eager_ddp(tmp_path) -> None:
    hooks = list(HOOKS)
    run_ranks(len(hooks), _worker, str(tmp_path / "store"), hooks, str(tmp_path), "cuda:0", "inductor", timeout=TIMEOUT)
    results = {h: json.loads((tmp_path / f"{h}.json").read_text()) for h in hooks}
    print(table(results))
    problems = [p for h, configs in results.items() for c, r in configs.items() for p in failures(h, c, r)]
    assert not problems, "\n".join(problems)
