"""The fused strategy against eager DDP on 2 real gloo ranks.

Every case of the foundation suite (tests/distributed/test_split_correctness.py) runs again with
``strategy="fused"``: per step, losses, every gradient after reduction, every parameter after the
optimizer step and every buffer must equal eager DDP's. Then the cases only the fused strategy
has: eager-produced gradients (a ``torch.compiler.disable``d submodule, a parameter used inside
and outside a graph), comm hooks (reproduced in the graph, or a fallback to ``split`` with the
reason), ``no_sync()`` without a recompile per step, and the idle reducer.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from support.ddp_cases import CASES, ReentrantCheckpoint, _run
from support.dist import run_distributed
from torch.nn.parallel import DistributedDataParallel as DDP

import bucketwise

# Cases whose model has no DDP parameters compiled through DDP, or that are specific to split.
_SKIP = {"compile_cap_only": "about split's alignment with a cap only compile() knows"}


def _assert_fused(report: dict[str, Any], *, min_buckets: int = 1) -> None:
    graphs = [g for g in report["graphs"] if g["strategy"] == "fused"]
    assert graphs, [(g["strategy"], g["strategy_reason"]) for g in report["graphs"]]
    assert report["totals"]["fallbacks"] == 0, report
    assert max(len(g["buckets"]) for g in graphs) >= min_buckets, [len(g["buckets"]) for g in graphs]
    for g in graphs:
        assert len(g["segments"]) == 1, g  # compiled whole: bucket size does not cut the graph
        for b in g["buckets"]:
            assert 0.0 <= b["issued_at"] <= 1.0 and b["comm_dtype"], b
    # The reducer stays idle: there is no alignment to measure, and its bucket buffers are
    # released (NOTE [released reducer]).
    assert report["alignment"]["alignment"] is None, report["alignment"]
    assert any("bucket buffers released" in n for n in report["notes"]), report["notes"]


@pytest.mark.parametrize("case", sorted(c for c in CASES if c not in _SKIP and not c.startswith("inductor")))
def test_fused_matches_eager_ddp(tmp_path, case):
    results = _run(tmp_path, case, "fused")
    for r in results:
        _assert_fused(r["report"])
        if case == "checkpoint_reentrant":  # the blocks' recompute runs eagerly, and the report says so
            notes = [n for n in r["report"]["notes"] if "got their gradients from code Dynamo ran eagerly" in n]
            assert notes and notes[0].startswith("8 parameter(s) (blocks."), r["report"]["notes"]


@pytest.mark.inductor
def test_fused_inductor_matches_eager_ddp(tmp_path):
    results = _run(tmp_path, "inductor_mlp", "fused", backend="inductor")
    for r in results:
        _assert_fused(r["report"], min_buckets=2)


def _inductor_backward_calls(rank: int, world: int, variant: str, cache_dir: str) -> dict[str, Any]:
    """Trains eager DDP and the fused Inductor compile side by side and returns, for each emitted
    graph with collectives, its calls in order: "AR" (all-reduce), "W" (wait), "K" (a kernel).
    ``variant``: "fp32"; "fp16-autocast" (torch's fp16 comm hook on both, a decompress reading
    each reduced bucket, under bf16 autocast: low-precision gradients, compressed wire, the shape
    of gpt's bf16 runs on GPU)."""
    import contextlib
    import glob
    import os
    import re

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from bucketwise.launch.models import GPT, GPTConfig

    # One cache for both ranks: the rank that compiles a kernel second loads the first's build.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    torch.manual_seed(0)
    # A small GPT: its untied LM head is the first and largest bucket the backward fills.
    net = GPT(GPTConfig(vocab=2048, seq=16, layers=2, d_model=32, heads=2))
    ref = DDP(copy.deepcopy(net), bucket_cap_mb=0.05)
    ddp = DDP(net, bucket_cap_mb=0.05)
    rtol, atol = 1e-4, 1e-5  # Inductor's fused kernels vs eager
    if variant.startswith("fp16"):  # (the bf16 hook needs CUDA)
        ref.register_comm_hook(None, default_hooks.fp16_compress_hook)
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        rtol, atol = 1e-3, 1e-4  # fp16 on the wire
    autocast = variant.endswith("autocast")
    if autocast:
        rtol, atol = 2e-2, 2e-3  # bf16 matmuls: Inductor and eager round differently
    compiled = bucketwise.compile(ddp, backend="inductor", strategy="fused")
    for step in range(2):
        x = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(100 * rank + step))
        for model in (ref, compiled):
            with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
                loss = model(x).float().pow(2).mean()
            loss.backward()
        for (name, p), q in zip(ref.named_parameters(), compiled.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=rtol, atol=atol, msg=lambda m: f"step {step} {name}: {m}")
            p.grad = q.grad = None
    call = re.compile(
        r"^\s+(?:\w+ = )?torch\.ops\._c10d_functional\.(all_reduce_|all_gather_into_tensor|wait_tensor)\.default\("
        r"|^\s+(?:cpp_fused_\w+|extern_kernels\.\w+|torch\.ops\.bucketwise\.\w+)"
    )
    graphs = []
    for path in glob.glob(os.path.join(cache_dir, "**", "*.py"), recursive=True):
        text = open(path).read()
        if "all_reduce_" in text:
            calls = [call.search(line) for line in text.split("def call(", 1)[1].splitlines()]
            kind = {"all_reduce_": "AR", "all_gather_into_tensor": "AG", "wait_tensor": "W"}
            graphs.append([kind.get(m.group(1), "K") for m in calls if m])
    buckets = [[b["collective"] for b in g["buckets"]] for g in bucketwise.report(compiled).to_dict()["graphs"]]
    return {"graphs": graphs, "buckets": buckets}


@pytest.mark.inductor
@pytest.mark.parametrize("variant", ["fp32", "fp16-autocast"])
def test_fused_inductor_overlaps_every_bucket(tmp_path, variant):
    # NOTE [late waits] (distributed/cc.py): left to itself Inductor puts each
    # wait before the next allreduce (one bucket in flight), and under autocast with a compress
    # hook it issued the first bucket's allreduce after the whole backward (with our first pass).
    args = (variant, str(tmp_path / "inductor"))
    for r in run_distributed(_inductor_backward_calls, tmp_path, args=args, timeout=400):
        assert len(r["buckets"]) == 1, r["buckets"]  # one graph
        # Several buckets; the token embedding is gathered as rows (NOTE [embedding rows]).
        n = r["buckets"][0].count("all_reduce")
        assert n >= 3 and r["buckets"][0].count("all_gather rows") == 1, r["buckets"]
        assert len(r["graphs"]) == 1, r["graphs"]  # one emitted backward with collectives
        calls = r["graphs"][0]
        ar = [i for i, c in enumerate(calls) if c == "AR"]
        ag = [i for i, c in enumerate(calls) if c == "AG"]  # the rows, with their ids
        waits = [i for i, c in enumerate(calls) if c == "W"]
        assert len(ar) == n and len(ag) == 1 and len(waits) == n + 1, calls
        assert max(ar + ag) < min(waits), f"a wait before a collective: {calls}"
        # The first bucket (the LM head) is reduced while the rest of the backward computes.
        kernels_before = calls[: ar[0]].count("K")
        assert kernels_before < calls.count("K") / 4, f"first allreduce after {kernels_before} kernels: {calls}"


def test_fused_no_sync_compiles_once_per_variant(tmp_path):
    results = _run(tmp_path, "no_sync", "fused")
    for r in results:
        rep = r["report"]
        # One synced and one no_sync variant per frame, no recompile per step.
        assert rep["totals"]["recompiles"] == 0, rep
        assert sorted(g["strategy"] for g in rep["graphs"]) == ["fused", "none"], rep["graphs"]
        nosync = next(g for g in rep["graphs"] if g["strategy"] == "none")
        assert "no_sync" in nosync["strategy_reason"]


# --- fused-only cases ---------------------------------------------------------------------


class EagerRegions(nn.Module):
    """``d`` lives in a ``torch.compiler.disable``d method (its gradient is produced eagerly);
    ``a.weight`` is used in the compiled graph and again inside that eager method."""

    def __init__(self, mixed: bool) -> None:
        super().__init__()
        self.a, self.b, self.d, self.c = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 4)
        self.mixed = mixed

    @torch.compiler.disable
    def eager_part(self, x: torch.Tensor) -> torch.Tensor:
        y = F.gelu(self.d(x))
        return y + self.a.weight.sum() * 0.01 if self.mixed else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.a(x))
        x = self.eager_part(x)
        return self.c(F.gelu(self.b(x)))


def _custom_hook(state, bucket):
    """A user comm hook bucketwise cannot reproduce in a graph (it is not one of torch's)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.allreduce_hook(state, bucket)


# DDP checks the annotations' objects; this module's `from __future__ import annotations`
# would make them strings.
_custom_hook.__annotations__ = {
    "state": object,
    "bucket": torch.distributed.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def _train_fused(rank: int, world: int, variant: str, micro: int) -> dict[str, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import bucketwise

    torch.manual_seed(0)
    model = EagerRegions(mixed=variant == "mixed")
    ref = DDP(model, bucket_cap_mb=0.01)
    ddp = DDP(copy.deepcopy(model), bucket_cap_mb=0.01)
    rtol, atol = 1e-5, 1e-6
    if variant == "fp16_hook":
        ref.register_comm_hook(None, default_hooks.fp16_compress_hook)
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    if variant == "custom_hook":
        ref.register_comm_hook(None, _custom_hook)
        ddp.register_comm_hook(None, _custom_hook)
    compiled = bucketwise.compile(ddp, backend="aot_eager", strategy="auto")
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_cmp = torch.optim.SGD(compiled.parameters(), lr=0.1)
    for step in range(3):
        for m, opt in ((ref, opt_ref), (compiled, opt_cmp)):
            opt.zero_grad(set_to_none=True)
            for k in range(micro):
                g = torch.Generator().manual_seed(1000 * rank + 10 * step + k)
                x = torch.randn(8, 16, generator=g)
                if k < micro - 1:
                    with m.no_sync():
                        m(x).pow(2).mean().backward()
                else:
                    m(x).pow(2).mean().backward()
        for (name, p), q in zip(ref.named_parameters(), compiled.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=rtol, atol=atol, msg=lambda s: f"step {step} {name}: {s}")
        opt_ref.step()
        opt_cmp.step()
    return bucketwise.report(compiled).to_dict()


@pytest.mark.parametrize(
    "variant,micro", [("disabled", 1), ("disabled", 3), ("mixed", 1), ("mixed", 3), ("fp16_hook", 1)]
)
def test_fused_eager_gradients_reduced_once(tmp_path, variant, micro):
    for rep in run_distributed(_train_fused, tmp_path, args=(variant, micro)):
        strategies = {g["strategy"] for g in rep["graphs"]}
        assert "fused" in strategies, rep["graphs"]
        if variant == "fp16_hook":
            dtypes = {b["comm_dtype"] for g in rep["graphs"] for b in g["buckets"]}
            assert dtypes == {"float16"}, dtypes


def test_fused_falls_back_to_split_for_unknown_comm_hook(tmp_path):
    for rep in run_distributed(_train_fused, tmp_path, args=("custom_hook", 1)):
        assert {g["strategy"] for g in rep["graphs"]} == {"split"}, rep["graphs"]
        assert all("_custom_hook" in g["strategy_reason"] for g in rep["graphs"]), rep["graphs"]
        assert all("traceable_comm_hook" in g["strategy_reason"] for g in rep["graphs"]), rep["graphs"]


class ReentrantTwice(nn.Module):
    """One block run twice under reentrant checkpointing: its parameters get two gradients in one
    backward, each from a backward of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(16, 32), nn.Linear(32, 4)
        self.block = ReentrantCheckpoint(nn.Linear(32, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.inp(x))
        x = self.block(self.block(x))
        return self.out(x)


def _reentrant_twice(rank: int, world: int) -> dict[str, str]:
    errors = {}
    for name in ("eager", "fused"):
        torch.manual_seed(0)
        ddp = DDP(ReentrantTwice())
        model = ddp if name == "eager" else bucketwise.compile(ddp, backend="aot_eager", strategy="fused")
        try:
            model(torch.randn(4, 16)).sum().backward()
        except RuntimeError as exc:
            errors[name] = str(exc)
    return errors


def test_fused_refuses_a_second_gradient_after_a_reentrant_backward_as_eager_ddp_does(tmp_path):
    """The first of the block's two gradients was averaged when its reentrant backward ended; the
    second cannot be told apart from it in ``.grad``. Eager DDP raises here too."""
    for errors in run_distributed(_reentrant_twice, tmp_path):
        assert "mark a variable ready only once" in errors.get("eager", ""), errors
        msg = errors.get("fused", "")
        assert "'block.block.weight'" in msg or "'block.block.bias'" in msg, errors
        assert "use_reentrant=False" in msg and "strategy='split'" in msg, msg


# --- rank safety --------------------------------------------------------------------------


class RankDependent(nn.Module):
    """Rank 0 runs ``a``, the others ``b``: same parameter shapes, different graphs."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.a, self.b, self.out = nn.Linear(16, 32), nn.Linear(16, 32), nn.Linear(32, 4)
        self.rank = rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.a(x) if self.rank == 0 else self.b(x)))


def _rank_dependent(rank: int, world: int) -> dict[str, str]:
    import bucketwise
    from bucketwise.distributed.rank_check import RankMismatchError

    out = {}
    # auto with find_unused_parameters=True runs split, which handles it
    # (tests/distributed/test_feature_matrix.py); fused refuses it. Without
    # find_unused_parameters auto picks fused, and eager DDP itself needs the flag here.
    for strategy, find_unused in (("fused", True), ("auto", False)):
        torch.manual_seed(0)
        compiled = bucketwise.compile(
            DDP(RankDependent(rank), bucket_cap_mb=0.001, find_unused_parameters=find_unused),
            backend="aot_eager",
            strategy=strategy,
        )
        try:
            compiled(torch.randn(4, 16)).sum().backward()
        except Exception as exc:  # Dynamo wraps backend errors
            cause = exc
            while cause is not None and not isinstance(cause, RankMismatchError):
                cause = cause.__cause__ or cause.__context__
            if cause is None:
                raise
            out[strategy] = str(cause)
            continue
        raise AssertionError(f"expected a RankMismatchError under {strategy}")
    return out


def test_fused_rank_mismatch_raises_on_every_rank(tmp_path):
    for messages in run_distributed(_rank_dependent, tmp_path, timeout=120):
        for msg in messages.values():
            assert "fused bucket layout differs between ranks" in msg, msg
            assert "rank 0 has" in msg and "rank 1 has" in msg, msg
            assert "a.weight" in msg or "a.bias" in msg, msg  # the differing bucket is named
        # and what fixes it: under fused with find_unused_parameters=True, the strategies that handle it
        assert "pass strategy='split' or 'auto'" in messages["fused"], messages["fused"]
        # under auto, the DDP flag that eager DDP needs too (auto then runs split); not a strategy
        # the user is already on
        auto = messages["auto"]
        assert "DDP(model, find_unused_parameters=True)" in auto and "keep strategy='auto'" in auto, auto
        assert "strategy='split' or 'auto'" not in auto, auto


class Switchable(nn.Module):
    """Reads ``a`` or ``b`` depending on a flag Dynamo guards on."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.out = nn.Linear(16, 32), nn.Linear(16, 32), nn.Linear(32, 4)
        self.use_b = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.b(x) if self.use_b else self.a(x)))


def _one_rank_recompiles(rank: int, world: int, change: str) -> None:
    import os

    import bucketwise

    os.environ["BUCKETWISE_RANK_CHECK_TIMEOUT"] = "5"
    torch.manual_seed(0)
    net = Switchable()
    compiled = bucketwise.compile(DDP(net, find_unused_parameters=True), backend="aot_eager", strategy="fused")
    for step in range(4):
        n = 4
        if rank == 0 and step >= 2:  # a recompile on rank 0 only
            if change == "layout":
                net.use_b = True  # another parameter: the allreduces no longer line up
            else:
                n = 6  # a new shape: same parameters, same buckets
        compiled(torch.randn(n, 16)).sum().backward()
    return [p.grad.clone() for p in net.parameters() if p.grad is not None]


def test_fused_recompile_on_one_rank_with_a_new_layout_raises(tmp_path):
    from support.dist import WorkerError

    with pytest.raises(WorkerError) as info:
        run_distributed(_one_rank_recompiles, tmp_path, args=("layout",), timeout=120)
    text = str(info.value)
    assert "RankMismatchError" in text and "rank 0: other ranks did not join" in text, text[-3000:]
    assert "recompiling (guard failed" in text and "use_b" in text, text[-3000:]


def test_fused_recompile_on_one_rank_with_the_same_layout_runs(tmp_path):
    grads = run_distributed(_one_rank_recompiles, tmp_path, args=("shape",), timeout=120)
    for a, b in zip(*grads):  # reduced: every rank holds the same gradients
        torch.testing.assert_close(a, b)


class _HalfDisabled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    @torch.compiler.disable
    def _eager(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._eager(torch.relu(self.a(x)))


def test_fused_hooks_only_parameters_no_graph_reduces(single_rank_group):
    # NOTE [fused strategy runtime] (2): a Python hook on every gradient would cost launch-bound
    # models a call per parameter per step; only parameters outside every graph carry one.
    torch.manual_seed(0)
    net = _HalfDisabled()
    ref = DDP(copy.deepcopy(net))
    compiled = bucketwise.compile(DDP(net), backend="aot_eager", strategy="fused")
    for _ in range(2):
        x = torch.randn(4, 8)
        compiled(x).sum().backward()
        ref(x).sum().backward()
    runtime = compiled._bucketwise.ddp.runtime
    hooked = set(runtime._hooks)
    assert hooked == {id(net.b.weight), id(net.b.bias)}, (hooked, [id(p) for p in net.parameters()])
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def _failing_backend(gm: Any, example_inputs: Any) -> Any:
    raise RuntimeError("this backend fails on purpose")


def _fallback_against_eager(rank: int, world: int, strategy: str) -> dict[str, Any]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ref = DDP(copy.deepcopy(net))
    compiled = bucketwise.compile(DDP(net), strategy=strategy, backend=_failing_backend)
    worst = 0.0
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * rank + step))
        for model in (ref, compiled):
            model(x).pow(2).mean().backward()
        for p, q in zip(ref.module.parameters(), net.parameters()):
            worst = max(worst, (p.grad - q.grad).abs().max().item())
            p.grad = q.grad = None
    report = bucketwise.report(compiled).to_dict()
    return {"worst": worst, "fallbacks": report["totals"]["fallbacks"], "strategies": report["graphs"][0]["strategy"]}


@pytest.mark.parametrize("strategy", ["fused", "split"])
def test_a_graph_that_does_not_compile_runs_eagerly_and_still_reduces_like_eager_ddp(tmp_path, strategy):
    """``fallback="eager"`` (the default): the graph runs uncompiled, said in the report, and every
    gradient is still reduced across the ranks as eager DDP reduces it."""
    for r in run_distributed(_fallback_against_eager, tmp_path, args=(strategy,)):
        assert r["fallbacks"] == 1 and r["strategies"] == strategy, r
        assert r["worst"] == 0.0, r


class _BreakingLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()  # the layer's forward is a frame of its own, compiled once
        return F.gelu(self.lin(x))


class _LayersOneGraph(nn.Module):
    """Four layers whose forward Dynamo compiles as one frame (and one recompile, for the first
    layer's input that needs no gradient) and runs for every layer, each with its own parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.l0, self.l1, self.l2, self.l3 = (_BreakingLayer() for _ in range(4))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.l3(self.l2(self.l1(self.l0(x)))))


def _layers_sharing_a_graph(rank: int, world: int) -> dict[str, Any]:
    import bucketwise

    torch.manual_seed(0)
    model = _LayersOneGraph()
    ref = DDP(model)
    compiled = bucketwise.compile(DDP(copy.deepcopy(model)), backend="aot_eager", strategy="fused")
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_cmp = torch.optim.SGD(compiled.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * rank + step))
        for m, opt in ((ref, opt_ref), (compiled, opt_cmp)):
            opt.zero_grad(set_to_none=True)
            m(x).pow(2).mean().backward()
        for (name, p), q in zip(ref.named_parameters(), compiled.parameters()):
            torch.testing.assert_close(q.grad, p.grad, msg=lambda s: f"step {step} {name}: {s}")
        opt_ref.step()
        opt_cmp.step()
    runtime = compiled._bucketwise.ddp.runtime
    return {"eager": sorted(runtime.eager_reduced.values()), "report": bucketwise.report(compiled).to_dict()}


def test_a_graph_run_for_several_layers_reduces_each_layers_parameters(tmp_path):
    # Each layer's gradients are reduced by the graph that ran on them, not again after the
    # backward as if eager code had made them.
    for r in run_distributed(_layers_sharing_a_graph, tmp_path):
        layer_graphs = [
            g for g in r["report"]["graphs"] if any(".lin." in p for s in g["segments"] for p in s["params"])
        ]
        assert len(layer_graphs) == 2, [(g["graph_id"], g["segments"][0]["params"]) for g in r["report"]["graphs"]]
        assert r["eager"] == [], r["eager"]
        # The break opening each layer ends no graph: the report says so instead of nothing.
        said = [n for n in r["report"]["notes"] if n.startswith("Dynamo met a graph break that no graph")]
        assert len(said) == 1 and "torch._dynamo.graph_break()" in said[0], r["report"]["notes"]
