"""torch's PowerSGD comm hook (``powerSGD_hook``) traced into the fused backward, bucket by bucket.

NOTE [powersgd in the graph]: ``powerSGD_hook(state, bucket)`` mixes host decisions with tensor
work. bucketwise splits them where they naturally fall:

- host, per compiled graph (``plan_bucket``): which tensors of a bucket are compressed (torch's
  ``_should_compress``: a tensor is viewed as ``n = shape[0]`` x ``m = the rest`` and compressed
  when ``(n + m) * r * min_compression_rate < n * m``, ``r = min(n, m, rank)``; so vectors stay
  uncompressed unless the rate is below 1), the batching of same-shape tensors, the offsets of
  each P and Q. A function of the bucket's shapes and the state's hyperparameters.
- host, per step (``powersgd_run.PowerSGDRun``, when the graph's forward is called): before
  ``start_powerSGD_iter`` the graph runs its plain variant (torch's ``allreduce_hook``: divide,
  then all-reduce), from then on the PowerSGD variant. Where torch draws a fresh Q (the first
  compressed step of a bucket under ``warm_start``, every step without) the seed comes from
  ``state.rng`` in bucket order, and the bucket's Q memory is written before the graph's forward
  runs: Q's orthogonalisation depends on no gradient, so AOTAutograd's partitioner may place it
  in the forward graph; written before, its placement does not matter. ``iter`` increases once
  per synced step, after the forward (torch: when the last bucket is reduced), and so do the
  compression statistics.
- graph, per bucket (``PowerSGDSync``): error feedback, the uncompressed all-reduce, P = M Q,
  all-reduce P, orthogonalise, Q = M^T P, all-reduce Q, divide, decompress, the new error, with
  functional collectives in the bucket's backward: it overlaps and compiles like any bucket.
  Collectives of bucket k keep their order (uncompressed, P, Q) and come before bucket k+1's;
  Q's all-reduce needs P's result, so the backward waits for P_k before computing Q_k.

State lives in torch's own ``PowerSGDState`` dicts, keyed by bucket index: ``error_dict``,
``p_memory_dict`` and ``q_memory_dict`` hold the very tensors the compiled backward reads and
updates. They are extra graph inputs (appended after Dynamo's) that do not require grad, written
with ``copy_`` in the backward: AOTAutograd keeps data mutations of forward inputs in the
backward graph (it supports them for Float8's buffers), so nothing is copied out after the step,
the tensors keep their address (CUDA-graph runners read them in place) and their values equal
torch's after every step (torch rebinds ``error_dict[i]`` to a new tensor each step, here it is
updated in place). Considered and not taken: a custom op declaring the state as mutated (the same
mechanism once functionalised, plus an opaque op), and handing the new state out as the
"gradient" of a dummy input (an extra copy per step). ``warm_start=False`` leaves both memory
dicts empty after each step, as torch does; the backward then reads private buffers. A graph
whose compile failed runs the same autograd function eagerly.

Variants: the plain all-reduce before ``start_powerSGD_iter``, PowerSGD after it, and PowerSGD
with the gradients already accumulated (below) are different graphs. Each Dynamo graph is
compiled once per variant it needs, when first needed (``comm_hooks.HookedGraph``, from a copy
of the Dynamo graph): crossing ``start_powerSGD_iter`` costs one compile, never one per step,
and is no Dynamo recompile (guards, ``freeze`` and the recompile limit are unaffected); the
report lists each compile (``variants``). ``compiler/module.py``'s ``no_sync`` variant is a
second Dynamo cache entry picked per call by the compiled module; the hook's variants are picked
inside the compiled callable instead, so the module needs no knowledge of hooks and ``no_sync``
keeps its collective-free graphs.

Accumulated gradients (``no_sync()`` micro-steps, or gradients not zeroed): eager DDP compresses
``accumulated + new``. Compression is not linear, so the fused runtime's averaging of the
accumulated part apart (NOTE [fused strategy runtime] (1)) would change the result; instead
the graph's forward call takes those gradients off the parameters and hands them to the
backward, which adds them to the new gradient before the hook, as DDP's bucket holds them.

Equal to eager DDP: the same aten ops run on the same values in the same order (torch's in-place
ops become out-of-place ones; Gram-Schmidt is torch's own function, see ``orthogonalize``); Q's
random values come from a generator seeded like torch's, and ``torch.manual_seed`` is replayed
after the forward for its side effect on the other devices' generators (torch seeds them inside
``fork_rng(devices=[])``, which restores only the CPU's), so dropout draws the same masks. Left
over on CPU: torch writes P and Q with ``bmm(out=...)`` into slices of one buffer, and MKL sums
in another order into a slice that is not 16-byte aligned (last bits). Equal results also need
the reducer's buckets: the fused plan follows DDP's bucket assignment over the predicted ready
order, which is the reducer's rebuilt buckets for a model compiled as one graph. With several
graphs (each plans its own buckets) or ``find_unused_parameters=True`` (the reducer keeps its
construction-time buckets) the buckets differ, and with them the random projections: PowerSGD
still, not eager's numbers (the report notes it). Gradients produced outside compiled graphs
(a ``torch.compiler.disable``d submodule, the eager uses of a parameter) are averaged apart,
uncompressed (NOTE [fused strategy runtime] (2), (3)), and a parameter read by two graphs is
compressed in each graph's bucket, where eager DDP compresses the sum once.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Sequence

import torch

from ..._compat import collectives as cc
from ..._compat import ddp as ddpc
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
    """torch's decisions for a bucket of gradients of these shapes (``powerSGD_hook`` step I and
    ``maybe_batched_tensors_to_compress``)."""
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
    """torch's ``_orthogonalize`` of a ``batch x rows x cols`` tensor, out of place: Gram-Schmidt
    for at most 2 columns or half precision, else QR.

    Gram-Schmidt is torch's own function, run on a contiguous copy: it works in place, and its
    reductions over one column of the batch (strided) sum in another order than over the same
    column copied out, so only the same ops on the same layout give the same bits. QR is the
    functional op (torch writes it with ``out=``, which traced code cannot keep: the traced
    output takes QR's column-major strides), made contiguous again."""
    if matrices.shape[2] <= 2 or matrices.dtype in (torch.float16, torch.bfloat16):
        out = matrices.clone(memory_format=torch.contiguous_format)
        ddpc.powersgd_gram_schmidt_(out, epsilon)
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
    """torch's ``powerSGD_hook`` on one bucket buffer once compression is on, out of place.

    Returns the reduced buffer, the new error (``None`` without error feedback), and the new
    contents of the P and Q memories."""
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
    """Identity in the forward; torch's ``powerSGD_hook`` on the bucket in the backward, with the
    bucket's state tensors updated in place (NOTE [powersgd in the graph])."""

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
