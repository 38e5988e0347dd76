"""Every DDP feature under every strategy, against eager DDP on 2 real gloo ranks.

Each cell builds one model, wraps one copy in eager ``DDP`` and another in
``bucketwise.compile(DDP(...), strategy=...)`` (``aot_eager``) with the same DDP arguments, trains
each for a few steps on the same rank-specific batches and compares, step by step, the loss,
every gradient after the backward (after DDP's reduction), every parameter after the optimizer
step and every buffer. The eager model trains first, then the compiled one (a ``join()`` loop
needs its own pass over the data). A cell passes when everything is equal and the strategy the
report says it applied is the one the docs promise.

The cells of one strategy run one after the other in one pair of ranks (fresh Dynamo state per
cell) to keep the suite fast. ``docs/ddp-features.md`` carries the matrix as a table written from
``FEATURES`` (``python tests/distributed/test_feature_matrix.py --write-docs``); ``test_docs_table_is_current``
fails when the two differ.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import os
import sys
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from support.ddp_cases import MLP, BNNet, UnusedBranchNet, _mse, _x
from support.dist import run_distributed
from torch.nn.parallel import DistributedDataParallel as DDP

STRATEGIES = ("fused", "split", "none", "auto")
RTOL, ATOL = 1e-5, 1e-6  # aot_eager runs eager's aten kernels: equal up to summation order
DOCS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs", "ddp-features.md"
)
_BEGIN, _END = "<!-- feature-matrix:begin -->", "<!-- feature-matrix:end -->"


# --- models ------------------------------------------------------------------------------


class SparseNet(nn.Module):
    """An ``nn.Embedding(sparse=True)`` and an ``nn.EmbeddingBag(sparse=True)`` before dense layers."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 16, sparse=True)
        self.bag = nn.EmbeddingBag(40, 16, mode="mean", sparse=True)
        self.l1 = nn.Linear(16, 32)
        self.l2 = nn.Linear(32, 8)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx).mean(1) + self.bag(idx)
        return self.l2(F.gelu(self.l1(h)))


class MixedDtypeNet(nn.Module):
    """One layer with bfloat16 parameters between float32 ones (buckets are kept per dtype)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.mid = nn.Linear(64, 64).to(torch.bfloat16)
        self.out = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.inp(x))
        h = F.gelu(self.mid(h.to(torch.bfloat16))).float()
        return self.out(h)


class RunningStatNet(nn.Module):
    """Buffers written in the forward: a step counter and a running mean of the input."""

    def __init__(self) -> None:
        super().__init__()
        self.l0 = nn.Linear(32, 64)
        self.l1 = nn.Linear(64, 8)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("mean", torch.zeros(32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.steps += 1
            self.mean.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return self.l1(F.gelu(self.l0(x - self.mean)))


class TiedNet(nn.Module):
    """Input embedding and output projection share one weight."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 16)
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, 40, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(F.gelu(self.mid(self.emb(idx)))).mean(1)


def _frozen_mlp() -> nn.Module:
    model = MLP(depth=5)
    for layer in (model.layers[0], model.layers[2]):
        layer.requires_grad_(False)
    return model


def _ignored_mlp() -> nn.Module:
    model = MLP(depth=5)
    DDP._set_params_and_buffers_to_ignore_for_model(model, ["layers.1.weight", "layers.1.bias"])
    return model


# --- inputs, losses, hooks ------------------------------------------------------------------


def _ids(rank: int, step: int) -> tuple:
    return (torch.randint(0, 40, (8, 5), generator=torch.Generator().manual_seed(1000 * rank + step)),)


def _out_loss(out: torch.Tensor, args: tuple) -> torch.Tensor:
    return out.float().pow(2).mean()


def _mse_loss(out: torch.Tensor, args: tuple) -> torch.Tensor:
    return _mse(out, args, 0)


def _unused_on_rank_1(rank: int, step: int) -> tuple:
    # The extra layer runs on rank 0 only: its gradient exists on one rank.
    return _x(rank, step)[0], rank == 0


def _every_other_step(rank: int, step: int) -> tuple:
    return _x(rank, step)[0], step % 2 == 1


def _hook(name: str) -> Callable[[DDP], None]:
    def register(ddp: DDP) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        if name in ("allreduce", "fp16"):
            fn = {"allreduce": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook}[name]
            ddp.register_comm_hook(None, fn)
        elif name == "powersgd":
            state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
            ddp.register_comm_hook(state, psgd.powerSGD_hook)
        else:
            ddp.register_comm_hook(None, _user_hook)

    return register


def _user_hook(state, bucket):  # noqa: ANN001 - DDP rejects a `bucket` annotation other than GradBucket
    """A user's own comm hook: average the bucket with a plain c10d allreduce."""
    buf = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda fut: fut.value()[0])


def _subgroup(module: nn.Module) -> dict:
    return {"process_group": dist.new_group(ranks=list(range(dist.get_world_size()))), "bucket_cap_mb": 0.01}


def _device_mesh(module: nn.Module) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    return {"device_mesh": init_device_mesh("cpu", (dist.get_world_size(),)), "bucket_cap_mb": 0.01}


def _delayed(module: nn.Module) -> dict:
    delayed = [(n, p) for n, p in module.named_parameters() if n.startswith("layers.2.")]
    # A whole number of MiB: torch 2.11's DDP hands the cap to _broadcast_coalesced, which takes an
    # int, when delay_all_reduce_named_params is set (1 MiB layers: still one bucket per layer).
    return {
        "delay_all_reduce_named_params": delayed,
        "param_to_hook_all_reduce": module.layers[0].weight,
        "bucket_cap_mb": 1,
    }


# --- the matrix --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Feature:
    what: str
    """Row label in the docs table."""
    model: Callable[[], nn.Module] = MLP
    ddp_kwargs: Callable[[nn.Module], dict] = lambda module: {"bucket_cap_mb": 0.01}
    """DDP arguments, built inside the ranks (process groups, meshes, parameter lists)."""
    inputs: Callable[[int, int], tuple] = _x
    loss: Callable[[Any, tuple], torch.Tensor] = _mse_loss
    steps: Callable[[int], int] = lambda rank: 4
    micro: int = 1
    """Micro-batches per step; all but the last run under ``no_sync()``."""
    join: bool = False
    """Train inside ``ddp.join()``."""
    hook: Callable[[DDP], None] | None = None
    optimizer: str = "sgd"
    runs: dict[str, str] = dataclasses.field(default_factory=dict)
    """Requested strategy -> the strategy the graphs get, where it is not the requested one
    (``auto`` -> ``fused`` otherwise)."""
    refuses: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    """Requested strategy -> what the error raised in ``bucketwise.compile`` or at the first
    compiled step must say (its type, then the strategies that support the feature), on every
    rank, instead of a hang or a wrong result."""
    note: str = ""
    """What the docs say beside the row."""
    barrier: bool = False
    """``dist.barrier()`` after each backward: DDP's delayed allreduce is launched async and never
    waited for (gloo's barrier waits for the group's earlier work)."""
    needs_ddp_arg: str | None = None
    """A DDP constructor argument older torch versions lack: the cell is skipped there."""
    ddp_may_refuse: str | None = None
    """The error with which some torch versions' own DDP constructor refuses the feature (before
    any collective): the cell is skipped there."""

    def expected(self, strategy: str) -> str:
        return self.runs.get(strategy, "fused" if strategy == "auto" else strategy)

    def available(self) -> bool:
        return self.needs_ddp_arg is None or self.needs_ddp_arg in inspect.signature(DDP.__init__).parameters


_SPLIT_FOR_UNUSED = {"auto": "split"}
_UNUSED_NOTE = "auto: runs `split` (ranks may use different parameters); `fused` works while they do not"

FEATURES: dict[str, Feature] = {
    "default_caps": Feature("default bucket caps (25 MiB, 1 MiB first)", ddp_kwargs=lambda m: {}),
    "small_caps": Feature("`bucket_cap_mb=0.01`"),
    "zero_cap": Feature(
        "`bucket_cap_mb=0` (one parameter per bucket)",
        ddp_kwargs=lambda m: {"bucket_cap_mb": 0},
        ddp_may_refuse="bucket_cap_mb should be set by now",
        note="torch 2.11's DDP itself refuses `bucket_cap_mb=0`",
    ),
    "cap_list": Feature(
        "`bucket_cap_mb_list`",
        needs_ddp_arg="bucket_cap_mb_list",
        ddp_kwargs=lambda m: {"bucket_cap_mb_list": [0.005, 0.01, 1]},
    ),
    "find_unused": Feature(
        "`find_unused_parameters=True`, a layer skipped every other step",
        model=UnusedBranchNet,
        inputs=_every_other_step,
        steps=lambda rank: 5,
        runs=_SPLIT_FOR_UNUSED,
        ddp_kwargs=lambda m: {"bucket_cap_mb": 0.01, "find_unused_parameters": True},
        note=_UNUSED_NOTE,
    ),
    "find_unused_rank": Feature(
        "`find_unused_parameters=True`, a layer used on one rank only",
        model=UnusedBranchNet,
        inputs=_unused_on_rank_1,
        runs=_SPLIT_FOR_UNUSED,
        refuses={"fused": ("RankMismatchError", "strategy='split'")},
        ddp_kwargs=lambda m: {"bucket_cap_mb": 0.01, "find_unused_parameters": True},
        note="fused: refused at the first step on every rank (the ranks' graphs differ)",
    ),
    "skip_unused": Feature(
        "`skip_all_reduce_unused_params=True`",
        model=UnusedBranchNet,
        inputs=_every_other_step,
        needs_ddp_arg="skip_all_reduce_unused_params",
        runs=_SPLIT_FOR_UNUSED,
        ddp_kwargs=lambda m: {
            "bucket_cap_mb": 0.01,
            "find_unused_parameters": True,
            "skip_all_reduce_unused_params": True,
        },
    ),
    "static_graph": Feature("`static_graph=True`", ddp_kwargs=lambda m: {"bucket_cap_mb": 0.01, "static_graph": True}),
    "grad_as_bucket_view": Feature(
        "`gradient_as_bucket_view=True`", ddp_kwargs=lambda m: {"bucket_cap_mb": 0.01, "gradient_as_bucket_view": True}
    ),
    "batched_grad_copy": Feature(
        "`batched_grad_copy=True`",
        needs_ddp_arg="batched_grad_copy",
        ddp_kwargs=lambda m: {"bucket_cap_mb": 0.01, "batched_grad_copy": True},
    ),
    "broadcast_buffers": Feature(
        "BatchNorm, `broadcast_buffers=True`",
        model=BNNet,
        ddp_kwargs=lambda m: {"bucket_cap_mb": 0.01, "broadcast_buffers": True},
    ),
    "no_broadcast_buffers": Feature(
        "BatchNorm, `broadcast_buffers=False`",
        model=BNNet,
        ddp_kwargs=lambda m: {"bucket_cap_mb": 0.01, "broadcast_buffers": False},
    ),
    "buffers_in_forward": Feature("buffers written in the forward", model=RunningStatNet),
    "init_sync": Feature(
        "`init_sync=False`", needs_ddp_arg="init_sync", ddp_kwargs=lambda m: {"bucket_cap_mb": 0.01, "init_sync": False}
    ),
    "subgroup": Feature("`process_group=` a `new_group`", ddp_kwargs=_subgroup),
    "device_mesh": Feature("`device_mesh=`", ddp_kwargs=_device_mesh),
    "delay_all_reduce": Feature(
        "`delay_all_reduce_named_params` (with `param_to_hook_all_reduce`)",
        model=lambda: MLP(width=512, depth=5),
        ddp_kwargs=_delayed,
        barrier=True,
        note="torch 2.11's DDP needs a whole-number `bucket_cap_mb` with it",
    ),
    "ignored": Feature("parameters set to be ignored", model=_ignored_mlp),
    "frozen": Feature("frozen parameters", model=_frozen_mlp),
    "tied": Feature("tied embedding / output weight", model=TiedNet, inputs=_ids, loss=_out_loss),
    "mixed_dtypes": Feature("float32 and bfloat16 parameters", model=MixedDtypeNet),
    "sparse": Feature(
        "`nn.Embedding(sparse=True)`, `nn.EmbeddingBag(sparse=True)`",
        model=SparseNet,
        inputs=_ids,
        loss=_out_loss,
        optimizer="plain-sgd",
        note="sparse gradients are reduced on their own, as DDP does",
    ),
    "no_sync": Feature("`no_sync()` gradient accumulation (3 micro-batches)", micro=3),
    "join": Feature(
        "`join()` with uneven inputs (5 and 3 batches)",
        join=True,
        steps=lambda rank: 5 - 2 * rank,
        note="fused: steps after a rank joined run with DDP's reducer",
    ),
    "join_no_sync": Feature(
        "`join()` with uneven inputs and `no_sync()`", join=True, micro=2, steps=lambda rank: 4 - rank
    ),
    "hook_allreduce": Feature("comm hook `allreduce_hook`", hook=_hook("allreduce")),
    "hook_fp16": Feature("comm hook `fp16_compress_hook`", hook=_hook("fp16")),
    # Default caps (one bucket here): torch's PowerSGD hooks wait on a collective inside a
    # future callback, which deadlocks gloo's worker threads with several buckets in flight.
    "hook_powersgd": Feature(
        "comm hook `powerSGD_hook` (start at step 2)",
        hook=_hook("powersgd"),
        steps=lambda rank: 5,
        ddp_kwargs=lambda m: {},
        note="fused: PowerSGD traced per bucket into the backward (tests/distributed/test_powersgd.py)",
    ),
    "hook_user": Feature(
        "a user's own comm hook (futures, `dist.all_reduce`)",
        hook=_hook("user"),
        runs={"auto": "split"},
        refuses={"fused": ("ValueError", "strategy='auto'", "strategy='split'")},
        note="auto: runs `split`, DDP's reducer runs the hook; fused: refused in `bucketwise.compile`, naming "
        "`auto` and `split`; `bucketwise.traceable_comm_hook` keeps a functional-collective hook fused",
    ),
}


# --- one cell ----------------------------------------------------------------------------


def _optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    if kind == "plain-sgd":  # sparse gradients: no momentum buffer
        return torch.optim.SGD(params, lr=0.1)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t.to_dense() if t.is_sparse else t


def _train(feature: Feature, model: Any, ddp: DDP, rank: int) -> list[dict[str, Any]]:
    """Per step: the loss, every gradient, every parameter after the step, every buffer."""
    opt = _optimizer(feature.optimizer, ddp.module.parameters())
    records = []
    with ddp.join() if feature.join else contextlib.nullcontext():
        for step in range(feature.steps(rank)):
            for micro in range(feature.micro):
                args = feature.inputs(rank, step * feature.micro + micro)
                with ddp.no_sync() if micro < feature.micro - 1 else contextlib.nullcontext():
                    loss = feature.loss(model(*args), args)
                    loss.backward()
            if feature.barrier:
                dist.barrier(group=ddp.process_group)
            grads = {n: None if p.grad is None else _dense(p.grad).clone() for n, p in ddp.module.named_parameters()}
            opt.step()
            opt.zero_grad(set_to_none=True)
            records.append(
                {
                    "loss": loss.detach().clone(),
                    "grads": grads,
                    "params": {n: p.detach().clone() for n, p in ddp.module.named_parameters()},
                    "buffers": {n: b.clone() for n, b in ddp.module.named_buffers()},
                }
            )
    return records


def _cell(rank: int, feature: Feature, strategy: str) -> dict[str, Any]:
    import bucketwise

    torch.manual_seed(0)
    base = feature.model()
    ref_module, cmp_module = copy.deepcopy(base), copy.deepcopy(base)
    try:
        ref = DDP(ref_module, **feature.ddp_kwargs(ref_module))
    except Exception as exc:  # noqa: BLE001 - this torch's DDP refuses the feature itself
        if feature.ddp_may_refuse is None or feature.ddp_may_refuse not in str(exc):
            raise
        return {"ddp_refuses": f"{type(exc).__name__}: {exc} (torch {torch.__version__})"}
    ddp = DDP(cmp_module, **feature.ddp_kwargs(cmp_module))
    if feature.hook is not None:
        feature.hook(ref)
        feature.hook(ddp)
    expected = _train(feature, ref, ref, rank)
    if strategy in feature.refuses:
        try:
            compiled = bucketwise.compile(ddp, backend="aot_eager", strategy=strategy)
            _train(feature, compiled, ddp, rank)
        except Exception as exc:  # noqa: BLE001 - the refusal under test
            return {"refused": f"{type(exc).__name__}: {exc}"}
        raise AssertionError(f"expected {feature.what} to be refused under {strategy}, it ran")
    compiled = bucketwise.compile(ddp, backend="aot_eager", strategy=strategy)
    actual = _train(feature, compiled, ddp, rank)
    assert len(actual) == len(expected), f"{len(actual)} steps, eager DDP {len(expected)}"
    for step, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(a["loss"], e["loss"], rtol=RTOL, atol=ATOL, msg=lambda m: f"step {step} loss: {m}")
        for kind in ("grads", "params", "buffers"):
            assert list(a[kind]) == list(e[kind]), (kind, list(a[kind]), list(e[kind]))
            for name, value in e[kind].items():
                if value is None or a[kind][name] is None:
                    assert value is None and a[kind][name] is None, f"step {step} {kind} {name}: one is None"
                    continue
                torch.testing.assert_close(
                    a[kind][name], value, rtol=RTOL, atol=ATOL, msg=lambda m: f"step {step} {kind} {name}: {m}"
                )
    report = bucketwise.report(compiled).to_dict()
    return {
        # The no_sync() variant's graphs (no collectives by design) are not what the step runs.
        "applied": sorted({g["strategy"] for g in report["graphs"] if g["variant"] is None}),
        "reasons": sorted({g["strategy_reason"] for g in report["graphs"] if g["strategy_reason"]}),
        "notes": report["notes"],
        "fallbacks": report["totals"]["fallbacks"],
    }


def run_cells(rank: int, world_size: int, strategy: str, names: list[str]) -> dict[str, Any]:
    """Every cell of one strategy on this rank; stops at the first failure (its collectives may
    be out of step with the other rank's from then on)."""
    import traceback

    out: dict[str, Any] = {}
    for name in names:
        torch._dynamo.reset()
        try:
            out[name] = _cell(rank, FEATURES[name], strategy)
        except Exception as exc:  # noqa: BLE001 - reported per cell by the test
            out[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
            break
    return out


# --- tests -------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_feature_matrix(tmp_path, strategy):
    names = [n for n, f in FEATURES.items() if f.available()]
    results = run_distributed(run_cells, tmp_path, args=(strategy, names), timeout=900)
    problems = []
    for rank, cells in enumerate(results):
        for name in names:
            cell = cells.get(name)
            if cell is None:
                problems.append(f"rank {rank} {name}: not run (an earlier cell failed)")
            elif "ddp_refuses" in cell:
                continue  # nothing to compare: eager DDP does not take it on this torch
            elif "error" in cell:
                problems.append(f"rank {rank} {name}: {cell['error']}\n{cell['traceback']}")
            elif strategy in FEATURES[name].refuses or "refused" in cell:
                missing = [
                    w
                    for w in FEATURES[name].refuses.get(strategy, ("<not refused>",))
                    if w not in cell.get("refused", "")
                ]
                if missing:
                    problems.append(f"rank {rank} {name}: refusal {cell.get('refused')!r} does not say {missing}")
            elif cell["applied"] != [FEATURES[name].expected(strategy)] or cell["fallbacks"]:
                problems.append(
                    f"rank {rank} {name}: ran {cell['applied']} ({cell['reasons']}), "
                    f"{cell['fallbacks']} fallbacks; expected {FEATURES[name].expected(strategy)}"
                )
    assert not problems, "\n".join(problems)


def markdown_table() -> str:
    head = "| DDP feature | " + " | ".join(f"`{s}`" for s in STRATEGIES) + " | notes |"
    rows = [head, "| --- | " + " | ".join("---" for _ in STRATEGIES) + " | --- |"]
    for f in FEATURES.values():
        cells = [_cell_text(f, s) for s in STRATEGIES]
        needs = f" (torch with `{f.needs_ddp_arg}`)" if f.needs_ddp_arg else ""
        rows.append(f"| {f.what}{needs} | " + " | ".join(cells) + f" | {f.note} |")
    return "\n".join(rows)


def _cell_text(feature: Feature, strategy: str) -> str:
    if strategy in feature.refuses:
        error, *names = feature.refuses[strategy]
        named = " and ".join(f"`{n.split('=')[1].strip(chr(39))}`" for n in names)
        return f"refused: `{error}` naming {named}"
    if feature.expected(strategy) == (strategy if strategy != "auto" else "fused"):
        return "equal"
    return f"equal (runs `{feature.expected(strategy)}`)"


def _docs_with_table(text: str) -> str:
    start, end = text.index(_BEGIN) + len(_BEGIN), text.index(_END)
    return text[:start] + "\n" + markdown_table() + "\n" + text[end:]


def test_docs_table_is_current():
    with open(DOCS) as f:
        text = f.read()
    assert text == _docs_with_table(text), (
        "docs/ddp-features.md is stale: python tests/distributed/test_feature_matrix.py --write-docs"
    )


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-docs"]:
        with open(DOCS) as f:
            text = f.read()
        with open(DOCS, "w") as f:
            f.write(_docs_with_table(text))
    else:
        print(markdown_table())
