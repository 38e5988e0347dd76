"""torch's PowerSGD comm hook (``powerSGD_hook``) traced into the fused backward, bucket by bucket.

NOTE [powersgd in the graph]: ``powerSGD_hook`` mixes host decisions with tensor work; we split
them so the graphs run the hook's ops in its order, with Q seeded as torch seeds it. The host
plans each bucket per graph (``plan_bucket``) and, per step (``powersgd_run.PowerSGDRun``),
picks the variant (plain all-reduce before ``start_powerSGD_iter``), advances ``iter`` and
writes Q's draws before the forward. The tensor work (``PowerSGDSync``) is traced into the
backward. State stays in torch's ``PowerSGDState`` dicts, updated in place (fixed addresses for
CUDA graphs). Accumulated gradients join the new ones before the hook (compression is not
linear). Each variant is a graph compiled on first need, not a Dynamo recompile.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Sequence

import torch

from ..._compat import collectives as cc
from ..._compat import ddp_hooks
from .sync import filled_grads, split_like

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PowerSGDConfig:
    """The ``PowerSGDState`` hyperparameters a compiled PowerSGD graph depends on."""

    group: str
    """Functional-collectives name of the state's process group (WORLD when it has none)."""
    world_size: int
    rank: int
    """``matrix_approximation_rank``."""
    min_compression_rate: float
    use_error_feedback: bool
    batch_same_shape: bool
    """``batch_tensors_with_same_shape``."""
    epsilon: float
    """``orthogonalization_epsilon``."""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"PowerSGDState.matrix_approximation_rank must be >= 1, got {self.rank}")
        if self.world_size < 1:
            raise ValueError(f"world size must be >= 1, got {self.world_size}")

    def as_args(self) -> tuple[Any, ...]:
        """The fields as graph arguments (see ``CommSpec.as_args``)."""
        return (
            self.group,
            self.world_size,
            self.rank,
            self.min_compression_rate,
            self.use_error_feedback,
            self.batch_same_shape,
            self.epsilon,
        )


# --- the plan of one bucket (host, per compiled graph) -------------------------------------


@dataclasses.dataclass(frozen=True)
class MatrixProduct:
    """One ``bmm`` of torch's hook: a tensor of the bucket viewed as ``n x m`` (or a stack of
    same-shape ones), compressed to ``P`` (``batch x n x r``) and ``Q`` (``batch x m x r``)."""

    members: tuple[int, ...]
    """Indices of the tensors in the bucket."""
    n: int
    m: int
    r: int
    p_offset: int
    q_offset: int

    @property
    def batch(self) -> int:
        return len(self.members)


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    """What torch's ``powerSGD_hook`` does with one bucket of these shapes."""

    shapes: tuple[tuple[int, ...], ...]
    uncompressed: tuple[int, ...]
    """Indices of the tensors all-reduced as they are, in bucket order."""
    products: tuple[MatrixProduct, ...]
    """In torch's order: by shape, shapes in order of first appearance."""
    p_numel: int
    q_numel: int
    numel_before: int
    numel_after: int
    """torch's compression statistics for one step of this bucket."""
    numel: int
    """Elements of the bucket."""

    @property
    def uncompressed_numel(self) -> int:
        return sum(math.prod(self.shapes[i]) for i in self.uncompressed)

    def wire_elements(self) -> dict[str, int]:
        """Elements each rank puts into each of the bucket's all-reduces (empty ones left out)."""
        parts = {"uncompressed": self.uncompressed_numel, "P": self.p_numel, "Q": self.q_numel}
        return {k: v for k, v in parts.items() if v}

    def q_shapes(self) -> list[tuple[int, int, int]]:
        return [(pr.batch, pr.m, pr.r) for pr in self.products]


def plan_bucket(
    shapes: Sequence[Sequence[int]], rank: int, min_compression_rate: float, batch_same_shape: bool
) -> BucketPlan:
    """torch's decisions for a bucket of gradients of these shapes (``powerSGD_hook`` step I)."""
    shapes = tuple(tuple(int(d) for d in s) for s in shapes)
    uncompressed: list[int] = []
    by_shape: dict[tuple[int, int], list[int]] = {}
    before = after = 0
    for i, shape in enumerate(shapes):
        if not shape:
            raise ValueError(
                f"powerSGD_hook cannot take a 0-dim gradient (tensor {i} of the bucket): "
                "torch's hook views each as shape[0] x rest and fails on it in eager DDP too"
            )
        n, m = shape[0], math.prod(shape[1:])
        r = min(n, m, rank)
        before += n * m
        if (n + m) * r * min_compression_rate < n * m:
            by_shape.setdefault((n, m), []).append(i)
            after += (n + m) * r
        else:
            uncompressed.append(i)
            after += n * m
    products: list[MatrixProduct] = []
    p_off = q_off = 0
    for (n, m), members in by_shape.items():
        r = min(n, m, rank)
        chunks = [tuple(members)] if batch_same_shape else [(i,) for i in members]
        for chunk in chunks:
            products.append(MatrixProduct(chunk, n, m, r, p_off, q_off))
            p_off += len(chunk) * n * r
            q_off += len(chunk) * m * r
    return BucketPlan(shapes, tuple(uncompressed), tuple(products), p_off, q_off, before, after, before)


# --- the tensor work (traced into the backward) --------------------------------------------


def orthogonalize(matrices: torch.Tensor, epsilon: float) -> torch.Tensor:
    """torch's ``_orthogonalize``, out of place. Gram-Schmidt runs on a contiguous copy (the same
    layout gives the same bits); QR's column-major output is made contiguous as torch's is."""
    if matrices.shape[2] <= 2 or matrices.dtype in (torch.float16, torch.bfloat16):
        out = matrices.clone(memory_format=torch.contiguous_format)
        ddp_hooks.powersgd_gram_schmidt_(out, epsilon)
        return out
    return torch.linalg.qr(matrices).Q.contiguous()


def _segments(flat: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    out, offset = [], 0
    for size in sizes:
        out.append(flat[offset : offset + size])
        offset += size
    return out


def powersgd_reduce(
    flat: torch.Tensor,
    plan: BucketPlan,
    cfg: PowerSGDConfig,
    error: torch.Tensor | None,
    p_mem: torch.Tensor,
    q_mem: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """torch's ``powerSGD_hook`` on one bucket once compression is on, out of place."""
    if cfg.use_error_feedback:
        flat = flat + error
    tensors = [seg.view(shape) for seg, shape in zip(_segments(flat, [math.prod(s) for s in plan.shapes]), plan.shapes)]
    out = list(tensors)
    if plan.uncompressed:
        memory = torch.cat([tensors[i].reshape(-1) for i in plan.uncompressed])
        memory = cc.all_reduce(memory, cfg.group) / cfg.world_size
        for i, seg in zip(plan.uncompressed, _segments(memory, [tensors[i].numel() for i in plan.uncompressed])):
            out[i] = seg.view_as(tensors[i])
    new_p, new_q = p_mem, q_mem
    if plan.products:
        mats = [_matrices(tensors, pr) for pr in plan.products]
        qs = [orthogonalize(q, cfg.epsilon) for q in _views(q_mem, plan.products, "q")]
        ps = [torch.bmm(mat, q) for mat, q in zip(mats, qs)]
        p_all = cc.all_reduce(torch.cat([p.reshape(-1) for p in ps]), cfg.group)
        ps = [orthogonalize(p, cfg.epsilon) for p in _views(p_all, plan.products, "p")]
        qs = [torch.bmm(mat.transpose(1, 2), p) for mat, p in zip(mats, ps)]
        new_q = cc.all_reduce(torch.cat([q.reshape(-1) for q in qs]), cfg.group) / cfg.world_size
        new_p = torch.cat([p.reshape(-1) for p in ps])
        for pr, p, q in zip(plan.products, ps, _views(new_q, plan.products, "q")):
            approx = torch.bmm(p, q.transpose(1, 2))
            for j, i in enumerate(pr.members):
                out[i] = approx[j].view(plan.shapes[i])
    reduced = torch.cat([t.reshape(-1) for t in out])
    return reduced, (flat - reduced if cfg.use_error_feedback else None), new_p, new_q


def _matrices(tensors: list[torch.Tensor], pr: MatrixProduct) -> torch.Tensor:
    mats = [tensors[i].view(pr.n, pr.m) for i in pr.members]
    return torch.stack(mats) if len(mats) > 1 else mats[0].unsqueeze(0)


def _views(memory: torch.Tensor, products: Sequence[MatrixProduct], which: str) -> list[torch.Tensor]:
    out = []
    for pr in products:
        rows = pr.n if which == "p" else pr.m
        start = pr.p_offset if which == "p" else pr.q_offset
        out.append(memory[start : start + pr.batch * rows * pr.r].view(pr.batch, rows, pr.r))
    return out


def state_layout(cfg: PowerSGDConfig, carry: bool) -> tuple[str, ...]:
    """The state tensors a bucket's PowerSGD sync takes before its parameters, in order."""
    return (("error",) if cfg.use_error_feedback else ()) + ("p", "q") + (("carry",) if carry else ())


class PowerSGDSync(torch.autograd.Function):
    """Identity forward; ``powerSGD_hook`` in the backward (NOTE [powersgd in the graph])."""

    @staticmethod
    def forward(ctx: Any, cfg: PowerSGDConfig, carry: bool, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        layout = state_layout(cfg, carry)
        state, params = tensors[: len(layout)], tensors[len(layout) :]
        # On ctx, not saved for backward: the forward call writes a fresh Q after this runs.
        ctx.cfg, ctx.state = cfg, dict(zip(layout, state))
        ctx.shapes = [(p.shape, p.dtype, p.device) for p in params]
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        cfg, state = ctx.cfg, ctx.state
        full = filled_grads(grads, ctx.shapes)
        flat = torch.cat([g.reshape(-1) for g in full])
        if "carry" in state:
            flat = state["carry"] + flat  # what DDP's bucket holds: accumulated + new
        plan = plan_bucket([s for s, _, _ in ctx.shapes], cfg.rank, cfg.min_compression_rate, cfg.batch_same_shape)
        reduced, error, p, q = powersgd_reduce(flat, plan, cfg, state.get("error"), state["p"], state["q"])
        if error is not None:
            state["error"].copy_(error)
        if plan.products:
            state["p"].copy_(p)
            state["q"].copy_(q)
        return (None, None, *[None] * len(state), *split_like(reduced, full))


def powersgd_sync(
    group: str,
    world_size: int,
    rank: int,
    min_compression_rate: float,
    use_error_feedback: bool,
    batch_same_shape: bool,
    epsilon: float,
    carry: bool,
    *tensors: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """The graph's call target (see ``fused.bucket_sync``)."""
    cfg = PowerSGDConfig(
        group=group,
        world_size=world_size,
        rank=rank,
        min_compression_rate=min_compression_rate,
        use_error_feedback=use_error_feedback,
        batch_same_shape=batch_same_shape,
        epsilon=epsilon,
    )
    return PowerSGDSync.apply(cfg, carry, *tensors)
