"""bucketwise.compile(DDP(model)) trains exactly like eager DDP(model).

Every test spawns a real 2-rank gloo group (tests/_dist.py). On each rank one worker builds
the model once, deep-copies it into an eager ``DDP`` and a ``bucketwise.compile(DDP(...))``,
feeds both the same rank-specific batches (different data on each rank, so the allreduce
matters) and compares, at every step, the loss, every gradient (after the backward, i.e.
after DDP's allreduce), every parameter after the optimizer step and, where asked, the
buffers. The worker returns the report so the test can assert segments/alignment.

Both models share the process group; their collectives run one model after the other, in
the same order on every rank.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import re
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint
from _dist import run_distributed
from torch.nn.parallel import DistributedDataParallel as DDP

STRATEGIES = ("split", "none")

# fp32 on CPU; aot_eager runs the same aten kernels as eager, so results agree to rounding.
RTOL, ATOL = 1e-5, 1e-6
STEPS = 4  # >= 3 optimizer steps; the reducer has rebuilt its buckets by the 3rd forward


# --- models --------------------------------------------------------------------------------


class MLP(nn.Module):
    """A plain (non-container) module: 4 linear layers of 16 KiB or less."""

    def __init__(self, d_in: int = 32, width: int = 64, d_out: int = 8, depth: int = 4) -> None:
        super().__init__()
        dims = [d_in] + [width] * (depth - 1) + [d_out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return x


class GraphBreakNet(nn.Module):
    """An explicit graph break, then a data-dependent branch (another graph break).

    Sizes: l0 8 KiB, l1 16 KiB, l2 and l3 4 KiB, l4 2 KiB, so at a 10 KiB cap one bucket
    (l4 + l3 + l2) must straddle the graph of l2 and the graph of l3/l4.
    """

    def __init__(self) -> None:
        super().__init__()
        self.l0 = nn.Linear(32, 64)
        self.l1 = nn.Linear(64, 64)
        self.l2 = nn.Linear(64, 16)
        self.l3 = nn.Linear(16, 64)
        self.l4 = nn.Linear(64, 8)

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.l1(F.gelu(self.l0(inp))))
        torch._dynamo.graph_break()
        x = F.gelu(self.l2(x))
        # Data-dependent (Dynamo breaks the graph here); with the test's seeds both ranks take
        # both branches within 6 steps.
        if inp.sum() > 0:
            x = self.l3(x)
        else:
            x = self.l3(-x) * 0.5
        return self.l4(F.gelu(x))


class CheckpointNet(nn.Module):
    """Two activation-checkpointed blocks (non-reentrant) between plain layers."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)) for _ in range(2))
        self.out = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.inp(x))
        for block in self.blocks:
            x = x + checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.out(x)


class TwoInputNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 64)
        self.b = nn.Linear(32, 64)
        self.mid = nn.Linear(64, 64)
        self.out = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.a(x)) + F.gelu(self.b(y)) * y.mean()
        return self.out(F.gelu(self.mid(h)))


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l0 = nn.Linear(32, 64)
        self.bn0 = nn.BatchNorm1d(64)
        self.l1 = nn.Linear(64, 64)
        self.bn1 = nn.BatchNorm1d(64)
        self.l2 = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.bn0(self.l0(x)))
        x = F.gelu(self.bn1(self.l1(x)))
        return self.l2(x)


class UnusedBranchNet(nn.Module):
    """``extra`` is used only when ``use_extra``; ``never`` is never used."""

    def __init__(self) -> None:
        super().__init__()
        self.l0 = nn.Linear(32, 64)
        self.extra = nn.Linear(64, 64)
        self.never = nn.Linear(64, 64)
        self.l1 = nn.Linear(64, 64)
        self.l2 = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        x = F.gelu(self.l0(x))
        if use_extra:
            x = F.gelu(self.extra(x))
        return self.l2(F.gelu(self.l1(x)))


class ParamFree(nn.Module):
    """No parameters at all: a fixed computation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) * 2.0 + x.sin()


class ParamFreePrologue(nn.Module):
    """The first Dynamo graph has no parameters (graph break before the first layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.l0 = nn.Linear(32, 64)
        self.mid = nn.Linear(64, 64)
        self.l1 = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(x) * 2.0 + x.sin()
        torch._dynamo.graph_break()
        return self.l1(F.gelu(self.mid(F.gelu(self.l0(x)))))


class SharedAcrossBreak(nn.Module):
    """One layer used on both sides of a graph break: its parameters are read by two graphs
    and get their gradient from both backwards."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.shared = nn.Linear(64, 64)
        self.mid = nn.Linear(64, 64)
        self.out = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.shared(F.gelu(self.inp(x))))
        torch._dynamo.graph_break()
        x = F.gelu(self.shared(F.gelu(self.mid(x))))
        return self.out(x)


def _tiny_gpt_config(**kw: Any):
    from bucketwise.launch.models import GPTConfig

    return GPTConfig(vocab=64, seq=8, layers=2, d_model=32, heads=2, **kw)


# --- cases ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    model: nn.Module
    inputs: Callable[[int, int], tuple]
    """(rank, step) -> positional args of the forward (fresh tensors)."""
    loss: Callable[[Any, tuple, int], torch.Tensor]
    """(output, args, step) -> scalar loss."""
    ddp_kwargs: dict = dataclasses.field(default_factory=dict)
    compile_kwargs: dict = dataclasses.field(default_factory=dict)
    optimizer: str = "adamw"
    ignore: list[str] | None = None
    check_buffers: bool = False
    """The model has buffers (buffers are compared at every step whatever this says)."""
    steps: int = STEPS
    micro: int = 1
    """Micro-batches per step: all but the last run under ``no_sync()`` (grad accumulation)."""


def _gen(rank: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 * rank + step)


def _x(rank: int, step: int, batch: int = 8, d: int = 32) -> tuple:
    return (torch.randn(batch, d, generator=_gen(rank, step)),)


def _target(x: torch.Tensor, d_out: int = 8) -> torch.Tensor:
    # A fixed nonlinear target of the input, identical for both models.
    return torch.tanh(x[:, :d_out] * 3.0)


def _mse(out: torch.Tensor, args: tuple, step: int) -> torch.Tensor:
    return F.mse_loss(out, _target(args[0]))


def case_mlp() -> Case:
    # 10 KiB buckets (the same cap given to DDP and to bucketwise.compile).
    return Case(MLP(), _x, _mse, ddp_kwargs={"bucket_cap_mb": 0.01}, compile_kwargs={"bucket_cap_mb": 0.01})


def case_compile_cap_only() -> Case:
    # The small cap is given to bucketwise.compile only; DDP keeps its 25 MiB default.
    return Case(MLP(), _x, _mse, compile_kwargs={"bucket_cap_mb": 0.01}, optimizer="sgd")


def case_sequential() -> Case:
    from bucketwise.launch.models import mlp

    # Caps left to DDP's own (bucketwise reads them from the DDP module).
    return Case(mlp(width=64, depth=4, d_in=32, d_out=8), _x, _mse, ddp_kwargs={"bucket_cap_mb": 0.01}, optimizer="sgd")


def _gpt_inputs(rank: int, step: int) -> tuple:
    from bucketwise.launch.models import synthetic_tokens

    idx, targets = synthetic_tokens(_tiny_gpt_config(), 4, seed=1000 * rank + step)
    return idx, targets


def _gpt_loss(out: torch.Tensor, args: tuple, step: int) -> torch.Tensor:
    return out  # GPT.forward(idx, targets) returns the loss


def case_gpt() -> Case:
    from bucketwise.launch.models import GPT

    # SGD: AdamW divides by sqrt(v), so last-bit differences in near-zero gradients (fused sums
    # the token embedding's rows in another order, NOTE [embedding rows]) become 1e-5 steps.
    return Case(GPT(_tiny_gpt_config()), _gpt_inputs, _gpt_loss, ddp_kwargs={"bucket_cap_mb": 0.02}, optimizer="sgd")


def case_gpt_tied() -> Case:
    from bucketwise.launch.models import GPT

    model = GPT(_tiny_gpt_config(tie_embeddings=True))
    assert model.head.weight is model.tok.weight
    return Case(
        model, _gpt_inputs, _gpt_loss, ddp_kwargs={"bucket_cap_mb": 0.02}, compile_kwargs={"bucket_cap_mb": 0.02}
    )


def case_frozen() -> Case:
    model = MLP(depth=5)
    for layer in (model.layers[0], model.layers[2]):
        layer.requires_grad_(False)
    return Case(model, _x, _mse, ddp_kwargs={"bucket_cap_mb": 0.01})


IGNORED = ["layers.1.weight", "layers.1.bias"]


def case_ignore() -> Case:
    return Case(MLP(depth=5), _x, _mse, ddp_kwargs={"bucket_cap_mb": 0.01}, ignore=IGNORED, optimizer="sgd")


def case_graph_break() -> Case:
    return Case(GraphBreakNet(), _x, _mse, ddp_kwargs={"bucket_cap_mb": 0.01}, steps=6)


def case_checkpoint() -> Case:
    return Case(CheckpointNet(), _x, _mse, ddp_kwargs={"bucket_cap_mb": 0.01})


DYNAMIC_BATCHES = [8, 5, 7, 3, 6]


def _dynamic_x(rank: int, step: int) -> tuple:
    return _x(rank, step, batch=DYNAMIC_BATCHES[step])


def case_dynamic() -> Case:
    return Case(
        MLP(),
        _dynamic_x,
        _mse,
        ddp_kwargs={"bucket_cap_mb": 0.01},
        compile_kwargs={"dynamic": True},
        steps=len(DYNAMIC_BATCHES),
    )


def case_auto_dynamic() -> Case:
    # dynamic=None (torch's default): static first compile, one recompile with a dynamic batch.
    return Case(MLP(), _dynamic_x, _mse, ddp_kwargs={"bucket_cap_mb": 0.01}, steps=len(DYNAMIC_BATCHES))


def case_no_sync() -> Case:
    return Case(MLP(), _x, _mse, ddp_kwargs={"bucket_cap_mb": 0.01}, micro=3, optimizer="sgd")


def case_static_graph() -> Case:
    return Case(CheckpointNet(), _x, _mse, ddp_kwargs={"bucket_cap_mb": 0.01, "static_graph": True})


def case_shared_across_break() -> Case:
    return Case(SharedAcrossBreak(), _x, _mse, ddp_kwargs={"bucket_cap_mb": 0.01})


def _same_tensor_twice(rank: int, step: int) -> tuple:
    (x,) = _x(rank, step)
    return x, x


def case_same_input_twice() -> Case:
    return Case(TwoInputNet(), _same_tensor_twice, _mse, ddp_kwargs={"bucket_cap_mb": 0.01})


def case_batchnorm() -> Case:
    return Case(
        BNNet(),
        _x,
        _mse,
        ddp_kwargs={"bucket_cap_mb": 0.01, "broadcast_buffers": True},
        check_buffers=True,
        optimizer="sgd",
    )


def _unused_inputs(rank: int, step: int) -> tuple:
    return _x(rank, step)[0], step % 2 == 1


def case_find_unused() -> Case:
    return Case(
        UnusedBranchNet(),
        _unused_inputs,
        _mse,
        ddp_kwargs={"bucket_cap_mb": 0.01, "find_unused_parameters": True},
        steps=5,
    )


def case_param_free_prologue() -> Case:
    return Case(ParamFreePrologue(), _x, _mse, ddp_kwargs={"bucket_cap_mb": 0.01})


def case_inductor_checkpoint() -> Case:
    # SGD, not AdamW: Adam's first step is ~lr * sign(grad), so a gradient element that is
    # ~0 up to rounding (Inductor's, not eager's) would move by a full lr either way.
    return Case(CheckpointNet(), _x, _mse, ddp_kwargs={"bucket_cap_mb": 0.01}, optimizer="sgd")


def case_inductor_mlp() -> Case:
    from bucketwise.launch.models import mlp

    return Case(
        mlp(width=32, depth=3, d_in=32, d_out=8), _x, _mse, ddp_kwargs={"bucket_cap_mb": 0.002}, optimizer="sgd"
    )


CASES: dict[str, Callable[[], Case]] = {
    name.removeprefix("case_"): fn for name, fn in dict(globals()).items() if name.startswith("case_")
}


# --- the worker ----------------------------------------------------------------------------


def _clone_args(args: tuple) -> tuple:
    """Fresh copies for the second model, keeping aliasing (the same tensor twice stays so)."""
    memo: dict[int, Any] = {}
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            if id(a) not in memo:
                memo[id(a)] = a.clone()
            out.append(memo[id(a)])
        else:
            out.append(a)
    return tuple(out)


def _optimizer(kind: str, params) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def _close(what: str, actual: Any, expected: Any, rtol: float, atol: float) -> None:
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def train_and_compare(
    rank: int,
    world_size: int,
    case_name: str,
    strategy: str,
    backend: str = "aot_eager",
    rtol: float = RTOL,
    atol: float = ATOL,
) -> dict[str, Any]:
    import bucketwise

    torch.manual_seed(0)
    case = CASES[case_name]()
    base = case.model
    ref_module = copy.deepcopy(base)
    cmp_module = copy.deepcopy(base)
    if case.ignore:
        DDP._set_params_and_buffers_to_ignore_for_model(ref_module, case.ignore)
        DDP._set_params_and_buffers_to_ignore_for_model(cmp_module, case.ignore)
    ref = DDP(ref_module, **case.ddp_kwargs)
    compiled = bucketwise.compile(
        DDP(cmp_module, **case.ddp_kwargs), backend=backend, strategy=strategy, **case.compile_kwargs
    )
    ref_opt = _optimizer(case.optimizer, ref_module.parameters())
    cmp_opt = _optimizer(case.optimizer, cmp_module.parameters())
    # The compiled object exposes the DDP module's names ("module.<fqn>") and tensors.
    ref_named = dict(ref.named_parameters())
    cmp_named = dict(compiled.named_parameters())
    assert list(ref_named) == list(cmp_named), f"parameter names differ: {list(ref_named)} vs {list(cmp_named)}"
    assert all(cmp_named["module." + n] is p for n, p in cmp_module.named_parameters()), "parameters not shared"
    assert list(compiled.state_dict()) == list(ref.state_dict())

    losses: list[tuple[float, float]] = []
    grad_norms: dict[str, list[float]] = {}
    for step in range(case.steps):
        for micro in range(case.micro):
            # Gradient accumulation: every micro-batch but the last skips the allreduce.
            accumulate = micro < case.micro - 1
            args = case.inputs(rank, step * case.micro + micro)
            with ref.no_sync() if accumulate else contextlib.nullcontext():
                ref_loss = case.loss(ref(*args), args, step)
                ref_loss.backward()
            cargs = _clone_args(args)
            with compiled.no_sync() if accumulate else contextlib.nullcontext():
                cmp_loss = case.loss(compiled(*cargs), cargs, step)
                cmp_loss.backward()
            _close(f"step {step}.{micro} loss", cmp_loss.detach(), ref_loss.detach(), rtol, atol)
        losses.append((ref_loss.item(), cmp_loss.item()))
        for name, p in ref_named.items():
            q = cmp_named[name]
            if p.grad is None or q.grad is None:
                assert p.grad is None and q.grad is None, (
                    f"step {step} grad of {name}: eager {'None' if p.grad is None else 'set'}, "
                    f"compiled {'None' if q.grad is None else 'set'}"
                )
                continue
            _close(f"step {step} grad of {name}", q.grad, p.grad, rtol, atol)
            grad_norms.setdefault(name.removeprefix("module."), []).append(p.grad.norm().item())
        ref_buffers = dict(ref_module.named_buffers())
        cmp_buffers = dict(cmp_module.named_buffers())
        assert list(ref_buffers) == list(cmp_buffers)
        assert bool(ref_buffers) == case.check_buffers
        for name, b in ref_buffers.items():
            _close(f"step {step} buffer {name}", cmp_buffers[name], b, rtol, atol)
        ref_opt.step()
        cmp_opt.step()
        for name, p in ref_named.items():
            _close(f"step {step} param {name} after optimizer step", cmp_named[name].detach(), p.detach(), rtol, atol)
        ref_opt.zero_grad(set_to_none=True)
        cmp_opt.zero_grad(set_to_none=True)

    rep = bucketwise.report(compiled)
    return {
        "losses": losses,
        "report": rep.to_dict(),
        "alignment": rep.alignment,
        "alignment_detail": rep.alignment_detail(),
        "grad_norms": grad_norms,
        "reducer_param_count": len([p for p in cmp_module.parameters() if p.requires_grad]),
    }


def _run(tmp_path, case: str, strategy: str, backend: str = "aot_eager", **kw: Any) -> list[dict[str, Any]]:
    results = run_distributed(train_and_compare, tmp_path, args=(case, strategy, backend), **kw)
    for r in results:
        assert len(r["losses"]) >= 3
        assert torch.isfinite(torch.tensor(r["losses"])).all(), r["losses"]
    # Different data per rank: the losses differ across ranks (else the test proves little).
    assert results[0]["losses"][0][0] != results[1]["losses"][0][0]
    return results


def _segments_per_graph(report: dict[str, Any]) -> list[int]:
    return [len(g["segments"]) for g in report["graphs"]]


def _assert_report_basics(report: dict[str, Any], strategy: str, *, min_split_segments: int | None = 2) -> None:
    assert report["totals"]["graphs"] >= 1, report
    assert report["totals"]["fallbacks"] == 0, report
    if strategy == "none":
        assert all(n == 1 for n in _segments_per_graph(report)), report
        assert all(g["strategy"] == "none" for g in report["graphs"]), report
    else:
        assert all(g["strategy"] == "split" for g in report["graphs"]), report
        if min_split_segments is not None:
            assert report["totals"]["segments"] >= min_split_segments, _segments_per_graph(report)
            assert max(_segments_per_graph(report)) >= min_split_segments, _segments_per_graph(report)


def _assert_aligned(result: dict[str, Any]) -> None:
    detail = result["alignment_detail"]
    assert result["alignment"] == 1.0, detail
    assert detail["status"].endswith("rebuilt"), detail
    assert all(b["status"] in ("aligned", "eager") for b in detail["buckets"]), detail


# --- tests ---------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_mlp(tmp_path, strategy):
    results = _run(tmp_path, "mlp", strategy)
    for r in results:
        # Buckets at a 10 KiB cap (ready order): [layers.3 (2 KiB) + layers.2 (16 KiB)],
        # [layers.1], [layers.0]: three segments.
        _assert_report_basics(r["report"], strategy, min_split_segments=3)
        _assert_aligned(r)
        assert r["report"]["totals"]["graphs"] == 1
        assert r["report"]["totals"]["recompiles"] == 0


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bucket_cap_given_to_compile_only(tmp_path, strategy):
    results = _run(tmp_path, "compile_cap_only", strategy)
    for r in results:
        rep = r["report"]
        # bucketwise.compile(bucket_cap_mb=0.01) plans and splits at 10 KiB ...
        # DDP's construction-time buckets are not contiguous in forward order here
        # ([l0, extra] and [never, l1] interleave with use order), so the split merges the
        # buckets that overlap into one segment: 2 segments, each holding whole buckets.
        _assert_report_basics(rep, strategy, min_split_segments=2)
        # ... but DDP's reducer was built with its own 25 MiB cap and rebuilds one bucket.
        # Segments that cannot coincide with the reducer's buckets must not pass silently:
        # either the buckets follow the requested cap (alignment 1.0) or the report says why
        # they cannot (a note about the bucket caps).
        if r["alignment"] != 1.0:
            assert any(re.search(r"bucket[ _]cap", n) for n in rep["notes"]), (r["alignment_detail"], rep["notes"])
        if strategy == "split":
            assert r["alignment"] < 1.0  # one 25 MiB reducer bucket across 3 segments


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sequential_container(tmp_path, strategy):
    # DDP(nn.Sequential): Dynamo skips torch.nn frames, bucketwise must still compile it.
    results = _run(tmp_path, "sequential", strategy)
    for r in results:
        rep = r["report"]
        assert rep["totals"]["graphs"] == 1 and rep["totals"]["graph_breaks"] == 0, rep
        # DDP's construction-time buckets are not contiguous in forward order here
        # ([l0, extra] and [never, l1] interleave with use order), so the split merges the
        # buckets that overlap into one segment: 2 segments, each holding whole buckets.
        _assert_report_basics(rep, strategy, min_split_segments=2)
        _assert_aligned(r)
        compiled_params = {p for g in rep["graphs"] for s in g["segments"] for p in s["params"]}
        assert len(compiled_params) == r["reducer_param_count"] == 8


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_transformer_lm(tmp_path, strategy):
    results = _run(tmp_path, "gpt", strategy)
    for r in results:
        _assert_report_basics(r["report"], strategy, min_split_segments=4)
        _assert_aligned(r)
        assert r["report"]["totals"]["graphs"] == 1


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_tied_embeddings(tmp_path, strategy):
    results = _run(tmp_path, "gpt_tied", strategy)
    for r in results:
        rep = r["report"]
        _assert_report_basics(rep, strategy, min_split_segments=4)
        _assert_aligned(r)
        names = [p for g in rep["graphs"] for s in g["segments"] for p in s["params"]]
        # The tied tensor is one reducer parameter (first name wins), counted once.
        assert names.count("tok.weight") == 1 and "head.weight" not in names, names
        assert len(names) == len(set(names)) == r["reducer_param_count"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_frozen_parameters(tmp_path, strategy):
    results = _run(tmp_path, "frozen", strategy)
    for r in results:
        rep = r["report"]
        # Trainable: layers.1, layers.3, layers.4 -> buckets [4 + 3], [1].
        _assert_report_basics(rep, strategy, min_split_segments=2)
        _assert_aligned(r)
        names = {p for g in rep["graphs"] for s in g["segments"] for p in s["params"]}
        assert not names & {"layers.0.weight", "layers.0.bias", "layers.2.weight", "layers.2.bias"}, names
        assert len(names) == r["reducer_param_count"] == 6


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_params_and_buffers_to_ignore(tmp_path, strategy):
    results = _run(tmp_path, "ignore", strategy)
    for r in results:
        rep = r["report"]
        # DDP's construction-time buckets are not contiguous in forward order here
        # ([l0, extra] and [never, l1] interleave with use order), so the split merges the
        # buckets that overlap into one segment: 2 segments, each holding whole buckets.
        _assert_report_basics(rep, strategy, min_split_segments=2)
        _assert_aligned(r)
        names = {p for g in rep["graphs"] for s in g["segments"] for p in s["params"]}
        assert not names & set(IGNORED), names
    # Ignored parameters are not allreduced: their gradients differ across ranks (both in the
    # eager reference and, by the per-rank comparison, in the compiled model) ...
    for name in IGNORED:
        assert results[0]["grad_norms"][name] != results[1]["grad_norms"][name]
    # ... while reduced ones are identical on every rank.
    assert results[0]["grad_norms"]["layers.0.weight"] == results[1]["grad_norms"]["layers.0.weight"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_graph_breaks(tmp_path, strategy):
    results = _run(tmp_path, "graph_break", strategy)
    for r in results:
        rep = r["report"]
        # graph_break() and the data-dependent `if` each cut the frame: l0/l1, l2, then one
        # graph per branch taken (both are).
        assert rep["totals"]["graphs"] == 4, rep
        assert rep["totals"]["graph_breaks"] >= 2, rep
        _assert_report_basics(rep, strategy, min_split_segments=None)
        if strategy == "split":
            # The first graph (l0, l1: 2 x >=8 KiB at a 10 KiB cap) must be split.
            assert _segments_per_graph(rep)[0] >= 2, _segments_per_graph(rep)
        detail = r["alignment_detail"]
        assert detail["status"].endswith("rebuilt"), detail
        # Gradients are ready graph by graph (l3/l4's graph, then l2's, then l0/l1's), and
        # the reducer packs them with the 10 KiB cap: [l4, l3, l2] | [l1] | [l0]. The first
        # bucket straddles two graphs: no split can align it (a graph boundary is not a bucket
        # boundary), so it is reported split across two *graphs*; the others are aligned.
        buckets = {tuple(sorted({p.split(".")[0] for p in b["params"]})): b["status"] for b in detail["buckets"]}
        assert set(buckets) == {("l2", "l3", "l4"), ("l1",), ("l0",)}, detail
        assert buckets[("l1",)] == buckets[("l0",)] == "aligned", detail
        straddle = buckets[("l2", "l3", "l4")]
        assert straddle.startswith("split across frame "), detail
        places = straddle.removeprefix("split across ").split(", ")
        graphs = [p.split(" segment ")[0] for p in places]
        assert len(places) == 2 and len(set(graphs)) == 2, f"must straddle two graphs, not segments of one: {detail}"
        assert r["alignment"] == pytest.approx(2 / 3), detail


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_activation_checkpoint(tmp_path, strategy):
    results = _run(tmp_path, "checkpoint", strategy)
    for r in results:
        rep = r["report"]
        # DDP's construction-time buckets are not contiguous in forward order here
        # ([l0, extra] and [never, l1] interleave with use order), so the split merges the
        # buckets that overlap into one segment: 2 segments, each holding whole buckets.
        _assert_report_basics(rep, strategy, min_split_segments=2)
        _assert_aligned(r)
        assert any("checkpoint" in h for g in rep["graphs"] for h in g["higher_order_ops"]), rep


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_dynamic_batch(tmp_path, strategy):
    results = _run(tmp_path, "dynamic", strategy)
    for r in results:
        rep = r["report"]
        # dynamic=True: the first compile is already shape-generic; no batch size recompiles.
        assert rep["totals"]["recompiles"] == 0, rep
        assert rep["totals"]["graphs"] == 1, rep
        # DDP's construction-time buckets are not contiguous in forward order here
        # ([l0, extra] and [never, l1] interleave with use order), so the split merges the
        # buckets that overlap into one segment: 2 segments, each holding whole buckets.
        _assert_report_basics(rep, strategy, min_split_segments=2)
        _assert_aligned(r)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_automatic_dynamic_recompile(tmp_path, strategy):
    results = _run(tmp_path, "auto_dynamic", strategy)
    for r in results:
        rep = r["report"]
        # dynamic=None: the second batch size recompiles once with a dynamic batch dimension;
        # the later sizes reuse it. Both compiles are split alike.
        assert rep["totals"]["recompiles"] == 1 and rep["totals"]["graphs"] == 2, rep
        assert [g["recompile"] for g in rep["graphs"]] == [False, True]
        # DDP's construction-time buckets are not contiguous in forward order here
        # ([l0, extra] and [never, l1] interleave with use order), so the split merges the
        # buckets that overlap into one segment: 2 segments, each holding whole buckets.
        _assert_report_basics(rep, strategy, min_split_segments=2)
        _assert_aligned(r)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_sync_gradient_accumulation(tmp_path, strategy):
    results = _run(tmp_path, "no_sync", strategy)
    for r in results:
        _assert_report_basics(r["report"], strategy, min_split_segments=3)
        assert r["report"]["totals"]["graphs"] == 1, r["report"]
        _assert_aligned(r)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_static_graph(tmp_path, strategy):
    results = _run(tmp_path, "static_graph", strategy)
    for r in results:
        _assert_report_basics(r["report"], strategy, min_split_segments=3)
        _assert_aligned(r)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_layer_shared_across_graph_break(tmp_path, strategy):
    results = _run(tmp_path, "shared_across_break", strategy)
    for r in results:
        rep = r["report"]
        assert rep["totals"]["graphs"] == 2, rep
        _assert_report_basics(rep, strategy, min_split_segments=None)
        # `shared` is read by both graphs; its gradient is complete only when the *first*
        # graph's backward has run (the autograd engine sums both contributions before its
        # AccumulateGrad fires). The reducer therefore buckets [out + mid] | [shared] | [inp]:
        # graph 1 must not plan `shared` as ready inside its own backward.
        _assert_aligned(r)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_same_tensor_as_two_inputs(tmp_path, strategy):
    results = _run(tmp_path, "same_input_twice", strategy)
    for r in results:
        # [out + mid], [b + a] at a 10 KiB cap.
        _assert_report_basics(r["report"], strategy, min_split_segments=2)
        _assert_aligned(r)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_batchnorm_broadcast_buffers(tmp_path, strategy):
    results = _run(tmp_path, "batchnorm", strategy)
    for r in results:
        # [l2 + bn1 + l1], [bn0 + l0] at a 10 KiB cap.
        _assert_report_basics(r["report"], strategy, min_split_segments=2)
        _assert_aligned(r)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_find_unused_parameters(tmp_path, strategy):
    results = _run(tmp_path, "find_unused", strategy)
    for r in results:
        rep = r["report"]
        # use_extra is a Python bool: one graph per value (the second a recompile).
        assert rep["totals"]["graphs"] == 2, rep
        # DDP's construction-time buckets are not contiguous in forward order here
        # ([l0, extra] and [never, l1] interleave with use order), so the split merges the
        # buckets that overlap into one segment: 2 segments, each holding whole buckets.
        _assert_report_basics(rep, strategy, min_split_segments=2)
        # Parameters a graph never reads are not part of it (Dynamo does not lift them).
        seg_params = [{p for s in g["segments"] for p in s["params"]} for g in rep["graphs"]]
        assert all(not {"never.weight", "never.bias"} & ps for ps in seg_params), seg_params
        assert sorted(ps >= {"extra.weight", "extra.bias"} for ps in seg_params) == [False, True], seg_params
        # find_unused_parameters=True: the reducer never rebuilds its buckets; it keeps the
        # construction-time assignment (reverse registration order), so alignment is measured
        # against those buckets.
        detail = r["alignment_detail"]
        assert detail["status"].endswith("initial"), detail
        assert r["alignment"] is not None, detail
        # Not 1.0 here (0.5 under split and none on torch 2.13): the buckets holding the
        # never-used `never` parameters count as not aligned (no compiled graph reads them).
        assert 0 < r["alignment"] <= 1, detail


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_param_free_first_graph(tmp_path, strategy):
    results = _run(tmp_path, "param_free_prologue", strategy)
    for r in results:
        rep = r["report"]
        assert rep["totals"]["graphs"] == 2, rep
        first, second = rep["graphs"]
        assert [p for s in first["segments"] for p in s["params"]] == [], first
        assert len(first["segments"]) == 1
        if strategy == "split":
            assert len(second["segments"]) == 2, second
        _assert_aligned(r)


def param_free_worker(rank: int, world_size: int, strategy: str) -> dict[str, Any]:
    import bucketwise

    model = ParamFree()
    # DDP itself refuses a module without parameters that require grad ...
    with pytest.raises(RuntimeError, match="doesn't have any parameter that requires a gradient"):
        DDP(model)
    frozen = nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(RuntimeError, match="doesn't have any parameter that requires a gradient"):
        DDP(frozen)
    # ... so there is no DDP module to hand to bucketwise; the parameter-free module itself
    # compiles (whole, no DDP to align with) and computes what eager computes.
    compiled = bucketwise.compile(model, backend="aot_eager", strategy=strategy)
    outs = []
    for step in range(3):
        (x,) = _x(rank, step)
        x.requires_grad_(True)
        xc = x.detach().clone().requires_grad_(True)
        expected = model(x)
        actual = compiled(xc)
        _close(f"step {step} output", actual, expected, RTOL, ATOL)
        expected.sum().backward()
        actual.sum().backward()
        _close(f"step {step} input grad", xc.grad, x.grad, RTOL, ATOL)
        outs.append(actual.sum().item())
    rep = bucketwise.report(compiled)
    return {"report": rep.to_dict(), "outs": outs}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_module_without_parameters(tmp_path, strategy):
    results = run_distributed(param_free_worker, tmp_path, args=(strategy,))
    for r in results:
        rep = r["report"]
        assert rep["totals"]["graphs"] == 1, rep
        assert rep["totals"]["segments"] == 1, rep
        assert rep["graphs"][0]["strategy"] == "none"
        assert rep["alignment"]["alignment"] is None


@pytest.mark.inductor
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_inductor_mlp(tmp_path, strategy):
    # Same tight tolerance as aot_eager: with SGD, Inductor's fused kernels stay within it.
    results = _run(tmp_path, "inductor_mlp", strategy, backend="inductor", timeout=400)
    for r in results:
        # 4 KiB hidden layers at a 2 KiB cap: [2 + 4] | [0].
        _assert_report_basics(r["report"], strategy, min_split_segments=2)
        assert all(s["backend"] == "inductor" for g in r["report"]["graphs"] for s in g["segments"])
        _assert_aligned(r)


@pytest.mark.inductor
def test_inductor_checkpoint_split(tmp_path):
    results = _run(tmp_path, "inductor_checkpoint", "split", backend="inductor", timeout=400)
    for r in results:
        _assert_report_basics(r["report"], "split", min_split_segments=3)
        assert all(s["backend"] == "inductor" for g in r["report"]["graphs"] for s in g["segments"])
        _assert_aligned(r)
