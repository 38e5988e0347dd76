"""One training step of a benchmark config, as every harness times it: build, wrap, step."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable

import torch
from torch.profiler import record_function

from bucketwise.benchmarks.core import metrics as bm
from bucketwise.benchmarks.core.configs import Prepared, Recipe
from bucketwise.benchmarks.core.isolation import own_code
from bucketwise.benchmarks.core.models import ModelSpec

LR = 1e-4
"""AdamW's learning rate in every harness."""
PHASES = ("forward", "backward", "optimizer", "zero_grad")
"""A step's phases, in order, as :func:`make_step`'s ``on_phase`` names them."""


def make_step(
    prepared: Prepared,
    spec: ModelSpec,
    opt: torch.optim.Optimizer,
    batch: tuple,
    device: torch.device,
    *,
    mark_cudagraph_step: bool,
    annotate: bool,
    on_phase: Callable[[str], None] | None = None,
) -> Callable[[], torch.Tensor]:
    """One training step: forward (bf16 autocast for gpt on CUDA) + backward + optimizer step
    + ``zero_grad(set_to_none=True)``; ``annotate`` adds the profiler ranges the trace parser uses;
    ``on_phase`` is called with each phase's name (``PHASES``) as it ends.
    Returns a copy of the loss, not read (no host sync): a CUDA-graph output is overwritten by
    the next replay, so the step clones it (one tiny device copy, in every config alike)."""
    module = prepared.module
    ended = on_phase or (lambda phase: None)

    def rng(name: str):
        return record_function(name) if annotate else nullcontext()

    def step() -> torch.Tensor:
        with rng(bm.STEP_RANGE):
            if mark_cudagraph_step:
                torch.compiler.cudagraph_mark_step_begin()
            with prepared.step_context():
                with spec.autocast(device):
                    loss = spec.loss(module, batch)
                ended("forward")
                with rng(bm.BACKWARD_RANGE):
                    loss.backward()
            ended("backward")
            kept = loss.detach().clone()
            opt.step()
            ended("optimizer")
            opt.zero_grad(set_to_none=True)
            ended("zero_grad")
        return kept

    return step


def training_step(
    recipe: Recipe,
    spec: ModelSpec,
    device: torch.device,
    backend: str,
    *,
    isolated: bool = False,
    bucket_cap_mb: float | None = None,
) -> tuple[torch.nn.Module, Prepared, torch.optim.Optimizer, Callable[[], torch.Tensor]]:
    """A config's model built (seed 0) and wrapped, its fused AdamW, and one training step on a
    fixed synthetic batch (:func:`make_step`): what the one-process harnesses (``tax``,
    ``memory``) time and measure. ``isolated``: the model gets code of its own
    (:func:`~bucketwise.benchmarks.core.isolation.own_code`), for a config built beside others in
    one process (NOTE [configs side by side])."""
    torch.manual_seed(0)
    model = spec.build().to(device)
    if isolated:
        own_code(model)
    prepared = recipe.prepare(model, device=device, backend=backend, bucket_cap_mb=bucket_cap_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True if device.type == "cuda" else None)
    step = make_step(
        prepared,
        spec,
        opt,
        spec.make_batch(1, device),
        device,
        mark_cudagraph_step=recipe.mode == "reduce-overhead",
        annotate=False,
    )
    return model, prepared, opt, step
