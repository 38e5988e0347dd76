"""Gradient parity with eager DDP across the model zoo, on one GPU.

Seven zoo models of different families train ``STEPS`` steps in fp32 (TF32 off, dropout off)
under eager DDP, plain ``torch.compile(DDP(model))`` and bucketwise's ``auto``, ``fused``,
``split``, ``fused`` with ``cudagraphs=True`` and ``share_blocks=True``. Every config starts each
step from eager DDP's parameters and buffers, copied in place (CUDA graphs read parameters at
their addresses), so each step's gradients are compared free of a trajectory's drift; the steps
cover the CUDA graphs' warm-up, recording and replays (T5 and Whisper once lost gradients from
the third step on: NOTE [a forward and its backward share a pool]).

A bucketwise config passes when its worst ``|g - g_ref| / |g_ref|`` over every step and every
parameter (``|g_ref|`` at least ``GRAD_FLOOR`` of the step's largest gradient: some gradients are
zero but for round-off) is at most ``FACTOR`` times plain torch.compile's worst distance from eager DDP on the
same model, or ``FLOOR``, the larger. Models where torch.compile itself is far from eager
(BatchNorm nets) are compared with torch.compile's gradients instead (``MODELS``). ``fused`` with
CUDA graphs must also have replayed some (``NO_REPLAYS``: the models where none can record).

Each model runs in its own spawned process (world size 1, NCCL, all on cuda:0), all at once:
its Inductor compiles take most of the time. Skipped without CUDA, transformers or torchvision.
"""

from __future__ import annotations

import copy
import dataclasses
import faulthandler
import gc
import json
import math
import os
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from support.gpu_ranks import run_ranks, world_of_one

import bucketwise
from bucketwise.benchmarks.zoo import registry
from bucketwise.benchmarks.zoo.procs import importable
from bucketwise.benchmarks.zoo.spec import forward_kwargs
from bucketwise.benchmarks.zoo.train import LR, TORCH_MIN_CAP_MB, make_ddp, to_device

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MODELS = {  # zoo name: the gradients bucketwise's configs are held to
    "llama": "eager",
    "gpt2": "eager",  # its head tied to the token embedding
    "t5": "eager",
    "whisper": "eager",
    "vit": "eager",
    "qwen2-moe": "eager",  # a mixture of experts, under find_unused_parameters=True
    "batchnorm-cudagraphs": "torch",  # resnet18 (BatchNorm): see _failures
}
GRAD_FLOOR = 1e-3
"""A parameter's gradient is measured against at least this fraction of the step's largest one."""
CONFIGS = {
    "auto": {},
    "fused": {"strategy": "fused"},
    "split": {"strategy": "split"},
    "fused-cg": {"strategy": "fused", "cudagraphs": True},
    "share-blocks": {"share_blocks": True},
}
NO_REPLAYS = {  # zoo name: why its fused-cg graphs record nothing (its gradients are still compared)
    "qwen2-moe": "transformers runs an fp32 MoE's compiled grouped matmul through its custom op "
    "grouped_mm_fallback, which reads the expert offsets on the host: no CUDA graph records it",
}
STEPS = 4  # CUDA graphs: warm-up, recording, then replays
FACTOR, FLOOR = 3.0, 1e-4
TIMEOUT = 480


def model_grads(
    name: str, device: torch.device | None = None, backend: str = "inductor", configs: dict = CONFIGS
) -> dict:
    """Per config (``torch`` included) the worst distance of its gradients from the model's
    reference over ``STEPS`` steps, as ``{"rel", "step", "param"}`` (and ``replays`` of CUDA
    graphs). Runs inside a one-rank process group."""
    device = device or torch.device("cuda", 0)
    spec = registry.get(name)
    torch.manual_seed(0)
    built = spec.build()
    init = built.module.to(device).train()
    batches = [to_device(built.batch_for(device)(0, step), device) for step in range(STEPS)]

    def ddp(module, cap=0.0):
        return make_ddp(dataclasses.replace(built, module=module), spec, device, min_cap_mb=cap)

    states, eager = _eager(ddp(copy.deepcopy(init)), built, batches)
    out, ref = {}, eager
    for config, kw in {"torch": None, **configs}.items():
        module = copy.deepcopy(init)
        if kw is None:  # DDPOptimizer needs a bucket cap of at least its 1 MiB first bucket
            call = torch.compile(ddp(module, TORCH_MIN_CAP_MB), backend=backend)
        else:
            call = bucketwise.compile(ddp(module), backend=backend, **kw)
        worst, grads = _steps(call, module, built, batches, states, ref)
        out[config] = dict(zip(("rel", "step", "param"), worst))
        if kw and kw.get("cudagraphs"):
            graphs = bucketwise.report(call).to_dict()["cudagraphs"]
            out[config]["replays"] = sum(g["replays"] for g in graphs)
            out[config]["not_captured"] = {g["name"]: g["reason"] for g in graphs if not g["captured"]}
        if kw is None and MODELS[name] == "torch":
            ref = grads
        del call, module, grads
        gc.collect()
        torch.compiler.reset()
    return out


def _eager(ddp, built, batches) -> tuple[list, list]:
    """Eager DDP's steps (SGD): the parameters and buffers each step starts from, and its gradients."""
    opt = torch.optim.SGD(ddp.module.parameters(), lr=LR)
    states, grads = [], []
    for batch in batches:
        states.append([t.detach().clone() for t in _tensors(ddp.module)])
        built.loss(ddp(**forward_kwargs(batch)), batch).backward()
        grads.append(_grads(ddp.module))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return states, grads


def _steps(call, module, built, batches, states, ref) -> tuple[tuple, list]:
    """Each step from eager's state at that step: the worst distance from ``ref`` as (rel, step,
    parameter), and every step's gradients."""
    worst, grads = (0.0, -1, ""), []
    for step, batch in enumerate(batches):
        with torch.no_grad():  # in place: CUDA graphs read parameters at their addresses
            for t, saved in zip(_tensors(module), states[step], strict=True):
                t.copy_(saved)
        built.loss(call(**forward_kwargs(batch)), batch).backward()
        grads.append(_grads(module))
        floor = GRAD_FLOOR * max((g.double().norm().item() for g in ref[step].values() if g is not None), default=0.0)
        rels = (_rel(ref[step][p], g, step, p, floor) for p, g in grads[-1].items())
        worst = max([worst, *rels], key=lambda w: w[0])
        module.zero_grad(set_to_none=True)
    return worst, grads


def _rel(
    ref: torch.Tensor | None, got: torch.Tensor | None, step: int, param: str, floor: float
) -> tuple[float, int, str]:
    """``|got - ref| / max(|ref|, floor)`` (Frobenius, float64). A gradient that is zero but for
    round-off (a key projection's bias, which softmax cancels) is measured against ``floor``, a
    fraction of the step's largest gradient, not against its own round-off. No gradient in the
    reference (a parameter left unused) must stay none or zero."""
    if ref is None:
        rel = 0.0 if got is None or not got.any() else math.inf
    else:
        ref = ref.double()
        diff = (ref - (0.0 if got is None else got.double())).norm().item()
        scale = max(ref.norm().item(), floor)
        rel = diff / scale if scale > 0 else diff
    return (math.inf if math.isnan(rel) else rel), step, param


def _tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in module.named_parameters()}


def _worker(rank: int, world: int, store: str, names: list[str], out_dir: str, errors) -> None:
    name = names[rank]
    try:
        faulthandler.dump_traceback_later(TIMEOUT - 30, exit=True)
        os.environ["HF_HUB_OFFLINE"] = "1"
        device = torch.device("cuda", 0)
        world_of_one(f"{store}-{name}", device)
        result = model_grads(name, device)
        Path(out_dir, f"{name}.json").write_text(json.dumps(result))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        errors.put(f"{name}: {traceback.format_exc()}")


def _failures(name: str, configs: dict) -> list[str]:
    """A bucketwise config farther from the model's reference than ``FACTOR`` times torch.compile's
    own distance from eager DDP (or ``FLOOR``), and CUDA graphs that never replayed.

    A BatchNorm net amplifies any compiler's round-off, so that compiled runs sit about as far
    from eager as from one another: bucketwise's gradients are held to torch.compile's at the same
    bound, which by the triangle inequality still keeps them within ``FACTOR + 1`` times
    torch.compile's distance from eager. A lost or doubled gradient is a distance of one, hence
    the check that the bound stays below one (else the test could not see it)."""
    t = configs["torch"]
    bound = max(FLOOR, FACTOR * t["rel"])
    yardstick = f"torch.compile(DDP) is {t['rel']:.3g} from eager DDP ({t['param']}, step {t['step']})"
    if not bound < 1.0:
        return [f"{name}: {yardstick}: a bound of {bound:.3g} would let a wrong gradient pass"]
    ref = "eager DDP's" if MODELS[name] == "eager" else "torch.compile(DDP)'s (BatchNorm: held to torch.compile's)"
    out = [
        f"{name} {config}: the gradient of {r['param']} at step {r['step']} is {r['rel']:.3g} from {ref}, "
        f"over {bound:.3g} ({FACTOR:g}x torch.compile's or {FLOOR:g}): {yardstick}"
        for config, r in configs.items()
        if config != "torch" and not r["rel"] <= bound
    ]
    out += [
        f"{name} {c}: no CUDA graph replayed; not captured: {r['not_captured']}"
        for c, r in configs.items()
        if r.get("replays") == 0 and name not in NO_REPLAYS
    ]
    return out


def _table(results: dict) -> str:
    """Per model and config: the reference, the worst distance, its step and parameter, and the
    CUDA graphs' replays."""
    rows = [f"{'model':<22}{'config':<14}{'against':<9}{'worst rel':>11}  step  {'replays':>7}  parameter"]
    for name, configs in results.items():
        for config, r in configs.items():
            against = "eager" if config == "torch" else MODELS[name]
            replays = r.get("replays", "")
            rows.append(
                f"{name:<22}{config:<14}{against:<9}{r['rel']:>11.3g}  {r['step']:>4}  {replays:>7}  {r['param']}"
            )
    return "\n".join(rows)


def test_zoo_gradients_match_eager_ddp_under_every_config(tmp_path) -> None:
    for package in sorted({p for name in MODELS for p in registry.get(name).needs}):
        why = importable(package)  # in a fresh interpreter: a wheel built for another torch fails there
        if why is not None:
            pytest.skip(f"needs {package}: import {package} failed: {why}")
    names = list(MODELS)
    run_ranks(len(names), _worker, str(tmp_path / "store"), names, str(tmp_path), timeout=TIMEOUT)
    results = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in names}
    print(_table(results))
    failures = [line for name, configs in results.items() for line in _failures(name, configs)]
    assert not failures, "\n".join(failures)
