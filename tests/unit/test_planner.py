"""Unit tests of the planner: bucket caps and plan (distributed/plan.py), parameter usage and
gradient-ready order (partitioners/param_usage.py) and the FX split (partitioners/split.py).

Graphs come from Dynamo itself (``torch.compile(fn, backend=recorder)`` records every graph
and its example inputs), without a process group; ``named_parameters()`` stand in for the
reducer's parameters unless a test needs DDP's own list (one-rank gloo group in-process).
References: eager autograd's real gradient-ready order (post-accumulate-grad hooks), DDP's
own C++ bucket assignment routine, DDP's ``_build_params_for_reducer`` and its rebuilt
buckets, and the original graph's outputs and gradients.
"""

from __future__ import annotations

import copy
import random
from typing import Any, Callable, Sequence

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint
from support.small_net import BlocksNet
from torch.nn.parallel import DistributedDataParallel as DDP

import bucketwise
from bucketwise._compat import ddp as ddpc
from bucketwise._compat import dynamo as dc
from bucketwise.compiler.segments import compile_with_fallback
from bucketwise.distributed.plan import BucketCaps, overlap_limits, plan_buckets
from bucketwise.distributed.result import GraphJob
from bucketwise.distributed.split.apply import split_and_compile
from bucketwise.launch.models import GPT, GPTConfig, mlp, synthetic_tokens
from bucketwise.partitioners.param_usage import (
    GraphParam,
    higher_order_ops,
    match_params,
    params_in_graph,
    ready_order,
)
from bucketwise.partitioners.split import SEGMENT_META_KEY, bucket_boundaries, split_graph

MIB = 1024 * 1024


# --- helpers -------------------------------------------------------------------------------


def find_graph_params(gm: fx.GraphModule, example_inputs: Sequence[Any], reducer_params: Any) -> list[GraphParam]:
    return params_in_graph(gm, match_params(gm, example_inputs, reducer_params))


def capture(fn: Callable[..., Any], *args: Any, **compile_kwargs: Any) -> list[tuple[fx.GraphModule, list[Any]]]:
    """Every (GraphModule, example_inputs) Dynamo hands to a backend while running fn(*args)."""
    graphs: list[tuple[fx.GraphModule, list[Any]]] = []

    def recorder(gm: fx.GraphModule, example_inputs: Sequence[Any]):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=recorder, **compile_kwargs)(*args)
    return graphs


def capture_one(model: nn.Module, *args: Any) -> tuple[fx.GraphModule, list[Any]]:
    # A closure (not torch.nn code) so Dynamo traces any module, containers included.
    graphs = capture(lambda *a: model(*a), *args)
    assert len(graphs) == 1, f"expected one graph, got {len(graphs)}"
    return graphs[0]


def eager_ready_order(model: nn.Module, loss_fn: Callable[[], torch.Tensor]) -> list[str]:
    """The order in which eager autograd accumulates each parameter's gradient."""
    names = {id(p): n for n, p in model.named_parameters()}
    order: list[str] = []
    handles = [
        p.register_post_accumulate_grad_hook(lambda p: order.append(names[id(p)]))
        for p in model.parameters()
        if p.requires_grad
    ]
    try:
        loss_fn().backward()
    finally:
        for h in handles:
            h.remove()
    model.zero_grad(set_to_none=True)
    return order


def names(params: Sequence[GraphParam]) -> list[str]:
    return [p.name for p in params]


def synthetic_params(sizes_bytes: Sequence[int], dtypes: Sequence[torch.dtype] | None = None) -> list[GraphParam]:
    """GraphParams (in the given = ready order) over real tensors of the given byte sizes."""
    out = []
    for i, nbytes in enumerate(sizes_bytes):
        dtype = dtypes[i] if dtypes else torch.float32
        elem = torch.empty((), dtype=dtype).element_size()
        assert nbytes % elem == 0
        t = torch.zeros(nbytes // elem, dtype=dtype)
        out.append(
            GraphParam(
                name=f"p{i}",
                reducer_index=i,
                node=None,  # type: ignore[arg-type]
                first_use=1000 - i,
                arg_position=0,
                nbytes=nbytes,
                dtype=dtype,
                in_higher_order_op=False,
                tensor=t,
            )
        )
    return out


def torch_assignment(tensors: Sequence[torch.Tensor], limits: Sequence[int]) -> list[list[int]]:
    """DDP's C++ routine, tensors given in ready order (as the reducer's rebuild passes them)."""
    indices, _ = dist._compute_bucket_assignment_by_size(
        list(tensors), list(limits), [False] * len(tensors), list(range(len(tensors)))
    )
    return [list(b) for b in indices]


def bucket_index_groups(buckets: Sequence[Sequence[GraphParam]], params: Sequence[GraphParam]) -> list[list[int]]:
    pos = {id(p): i for i, p in enumerate(params)}
    return [[pos[id(p)] for p in b] for b in buckets]


class TwoTowers(nn.Module):
    """Linear layers, a hand-written matmul+add (bias used after weight), a shared weight."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.w = nn.Parameter(torch.randn(32, 32) * 0.1)
        self.b = nn.Parameter(torch.zeros(32))
        self.shared = nn.Linear(32, 32)
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.a(x))
        h = F.gelu(h @ self.w + self.b)
        h = F.gelu(self.shared(h))
        h = F.gelu(self.shared(h))  # the same module (same parameters) twice
        return self.out(h)


class CheckpointNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.block = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.inp(x))
        x = x + checkpoint.checkpoint(self.block, x, use_reentrant=False)
        return self.out(x)


class BNFrozenNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l0 = nn.Linear(16, 32)
        self.bn = nn.BatchNorm1d(32)
        self.frozen = nn.Linear(32, 32).requires_grad_(False)
        self.register_buffer("scale", torch.full((32,), 0.5))
        self.l1 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.bn(self.l0(x)))
        x = F.gelu(self.frozen(x)) * self.scale
        return self.l1(x)


def tiny_gpt(tied: bool = False) -> tuple[GPT, tuple[torch.Tensor, torch.Tensor]]:
    cfg = GPTConfig(vocab=64, seq=8, layers=2, d_model=32, heads=2, tie_embeddings=tied)
    return GPT(cfg), synthetic_tokens(cfg, 2, seed=0)


def reference_ready_order(gm: fx.GraphModule, example_inputs: Sequence[Any], model: nn.Module) -> list[str]:
    """Spec, computed independently: sort the parameters by (first user node, argument
    position of the parameter in it), last first; each tensor once."""
    by_id = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    node_of = {
        node: by_id[id(v)]
        for node, v in zip(gm.graph.find_nodes(op="placeholder"), example_inputs)
        if isinstance(v, torch.Tensor) and id(v) in by_id
    }
    first: dict[str, tuple[int, int]] = {}
    for i, node in enumerate(gm.graph.nodes):
        flat: list[Any] = []
        fx.node.map_arg((node.args, node.kwargs), flat.append)
        for pos, arg in enumerate(flat):
            if arg in node_of and node_of[arg] not in first:
                first[node_of[arg]] = (i, pos)
    return sorted(first, key=lambda n: first[n], reverse=True)


# --- BucketCaps ----------------------------------------------------------------------------


def test_bucket_caps_limits_and_validation():
    assert BucketCaps(first_bytes=100, bytes=200).limits() == [100, 200]
    assert BucketCaps(first_bytes=100, bytes=200, per_bucket=(5, 6, 7)).limits() == [5, 6, 7]
    # 0 is a cap DDP accepts (one parameter per bucket); a negative one is a bug upstream.
    assert BucketCaps(first_bytes=0, bytes=0, per_bucket=(4, 0)).limits() == [4, 0]
    for bad in (
        {"first_bytes": -1, "bytes": 10},
        {"first_bytes": 10, "bytes": -1},
        {"first_bytes": 1, "bytes": 1, "per_bucket": (4, -1)},
    ):
        with pytest.raises(AssertionError, match="expected bucket caps >= 0"):
            BucketCaps(**bad)


def test_bucket_caps_from_ddp(single_rank_group):
    model = nn.Linear(4, 4)
    default = DDP(model)
    caps = BucketCaps.from_ddp(default)
    # DDP's defaults: 25 MiB buckets, a 1 MiB first bucket.
    assert caps.bytes == 25 * MIB
    assert caps.first_bytes == dist._DEFAULT_FIRST_BUCKET_BYTES == 1 * MIB
    assert caps.matches_ddp(default)

    explicit = DDP(nn.Linear(4, 4), bucket_cap_mb=0.5)
    caps = BucketCaps.from_ddp(explicit)
    # An explicit bucket_cap_mb makes DDP use it for the first bucket too.
    assert caps.limits() == [int(0.5 * MIB), int(0.5 * MIB)]
    assert caps.matches_ddp(explicit)

    # Overrides given to bucketwise.
    small = BucketCaps.from_ddp(default, bucket_cap_mb=0.1)
    assert small.bytes == int(0.1 * MIB) and small.first_bytes <= small.bytes
    assert not small.matches_ddp(default)
    big = BucketCaps.from_ddp(default, bucket_cap_mb=4)
    assert big.limits() == [1 * MIB, 4 * MIB]
    first = BucketCaps.from_ddp(explicit, first_bucket_cap_mb=0.05)
    assert first.limits() == [int(0.05 * MIB), int(0.5 * MIB)]

    per_bucket = DDP(nn.Linear(4, 4), bucket_cap_mb_list=[1, 2, 3])
    caps = BucketCaps.from_ddp(per_bucket)
    assert caps.limits() == [1 * MIB, 2 * MIB, 3 * MIB]
    assert caps.matches_ddp(per_bucket)


# --- plan_buckets --------------------------------------------------------------------------


def test_plan_closes_bucket_once_cap_reached_first_cap_first():
    # ready order sizes; first cap 500, then 1000
    params = synthetic_params([400, 400, 400, 800, 100, 100])
    buckets = plan_buckets(params, BucketCaps(first_bytes=500, bytes=1000))
    # [400+400 >= 500] closes bucket 0; [400+800 >= 1000] closes bucket 1; the rest stays open.
    assert [names(b) for b in buckets] == [["p0", "p1"], ["p2", "p3"], ["p4", "p5"]]
    # The same sizes with the large cap first: the first bucket takes more.
    buckets = plan_buckets(params, BucketCaps(first_bytes=1000, bytes=1000))
    assert [names(b) for b in buckets] == [["p0", "p1", "p2"], ["p3", "p4", "p5"]]
    # A parameter larger than the cap is a bucket of its own.
    buckets = plan_buckets(synthetic_params([40, 4000, 40]), BucketCaps(first_bytes=100, bytes=100))
    assert [names(b) for b in buckets] == [["p0", "p1"], ["p2"]]
    assert plan_buckets([], BucketCaps(first_bytes=1, bytes=1)) == []


@pytest.mark.parametrize("seed", range(6))
def test_plan_cap_semantics_random(seed):
    rng = random.Random(seed)
    sizes = [4 * rng.randint(1, 300) for _ in range(rng.randint(1, 40))]
    first, cap = 4 * rng.randint(1, 200), 4 * rng.randint(50, 400)
    params = synthetic_params(sizes)
    buckets = plan_buckets(params, BucketCaps(first_bytes=first, bytes=cap))
    # Every parameter exactly once, buckets contiguous in ready order.
    assert [p.name for b in buckets for p in b] == names(params)
    for i, b in enumerate(buckets):
        limit = first if i == 0 else cap
        total = sum(p.nbytes for p in b)
        if i < len(buckets) - 1:
            assert total >= limit, (i, total, limit)  # closed: it reached its cap ...
        assert total - b[-1].nbytes < limit, (i, total, limit)  # ... only with its last member


@pytest.mark.parametrize("seed", range(4))
def test_plan_matches_ddp_assignment_routine(seed):
    rng = random.Random(100 + seed)
    n = rng.randint(2, 30)
    dtypes = [rng.choice([torch.float32, torch.float32, torch.bfloat16]) for _ in range(n)]
    sizes = [4 * rng.randint(1, 500) for _ in range(n)]
    params = synthetic_params(sizes, dtypes)
    caps = BucketCaps(first_bytes=4 * rng.randint(10, 300), bytes=4 * rng.randint(100, 800))
    plan = bucket_index_groups(plan_buckets(params, caps), params)
    ref = torch_assignment([p.tensor for p in params], caps.limits())
    # Same membership as DDP's routine; keyed by dtype: a bucket never mixes dtypes.
    assert sorted(plan) == sorted(ref)
    for b in plan:
        assert len({dtypes[i] for i in b}) == 1
    # Returned in ready order of their first member.
    assert [min(b) for b in plan] == sorted(min(b) for b in plan)


def test_plan_for_overlap_quarters_then_halves_down_to_the_cap():
    """NOTE [fused bucket sizes]: a quarter of the bytes each, then halving, none below the cap;
    the allreduce of every bucket but the last has the rest of the backward to hide in."""
    assert overlap_limits(1000, 50) == [250, 250, 250, 125, 62, 50]
    assert overlap_limits(40, 50) == [50]  # all of it within one cap: one bucket, as DDP
    # 70 caps' worth of gradients (a 32-layer Llama's 1.76 GB against DDP's 25 MiB), scaled down.
    cap = 2**18
    params = synthetic_params([70 * cap // 100 // 4 * 4] * 100)
    total = sum(p.nbytes for p in params)
    buckets = plan_buckets(params, BucketCaps(first_bytes=cap // 25, bytes=cap, for_overlap=True))
    sizes = [sum(p.nbytes for p in b) for b in buckets]
    assert len(buckets) <= 10, sizes
    assert [p.name for b in buckets for p in b] == names(params)
    assert sizes[-1] <= 2 * cap and sizes[0] <= total // 4 + params[0].nbytes
    assert all(a >= b for a, b in zip(sizes, sizes[1:])), sizes  # never growing towards the end
    # DDP's own caps on the same parameters: a bucket per two parameters, a small one first.
    assert len(plan_buckets(params, BucketCaps(first_bytes=cap // 25, bytes=cap))) == 51


def test_fused_sizes_its_buckets_only_where_ddp_kept_its_default_caps(single_rank_group):
    from bucketwise.compiler.config import CompileConfig
    from bucketwise.compiler.decision import decide

    def caps(ddp, **config):
        return decide(CompileConfig(strategy="fused", **config), ddp, runs_ddp_forward=True, cudagraphs=False).caps

    default = DDP(nn.Linear(4, 4))
    assert caps(default).for_overlap
    assert not caps(default, bucket_cap_mb=25).for_overlap
    assert not caps(DDP(nn.Linear(4, 4), bucket_cap_mb=25)).for_overlap
    assert not caps(DDP(nn.Linear(4, 4), bucket_cap_mb_list=[1, 2])).for_overlap
    split = decide(CompileConfig(strategy="split"), default, runs_ddp_forward=True, cudagraphs=False)
    assert not split.caps.for_overlap and split.caps.matches_ddp(default)
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

    hooked = DDP(nn.Linear(4, 4))
    hooked.register_comm_hook(ps.PowerSGDState(None), ps.powerSGD_hook)  # it sees DDP's buckets, as in eager DDP
    assert not caps(hooked).for_overlap


def test_plan_per_bucket_caps_match_ddp_routine():
    params = synthetic_params([400] * 12)
    caps = BucketCaps(first_bytes=1, bytes=1, per_bucket=(400, 1200, 2000))
    plan = bucket_index_groups(plan_buckets(params, caps), params)
    assert plan == torch_assignment([p.tensor for p in params], caps.limits())
    assert plan[0] == [0] and plan[1] == [1, 2, 3]


# --- find_graph_params / ready_order -------------------------------------------------------


def test_ready_order_mlp_is_eager_gradient_order():
    model = mlp(width=32, depth=4, d_in=16, d_out=4)
    x = torch.randn(4, 16)
    gm, ex = capture_one(model, x)
    params = find_graph_params(gm, ex, list(model.named_parameters()))
    order = names(ready_order(params))
    # Reverse of first use, bias before weight (F.linear(x, w, b): b is the later argument).
    assert order == ["6.bias", "6.weight", "4.bias", "4.weight", "2.bias", "2.weight", "0.bias", "0.weight"]
    # ... which is what eager autograd really does.
    assert order == eager_ready_order(model, lambda: model(x).square().sum())


def test_ready_order_follows_first_use_and_tie_break():
    model = TwoTowers()
    x = torch.randn(4, 16)
    gm, ex = capture_one(model, x)
    params = find_graph_params(gm, ex, list(model.named_parameters()))
    order = names(ready_order(params))
    assert order == reference_ready_order(gm, ex, model)
    # `h @ w + b`: b's first use comes after w's, so b's gradient is ready first.
    assert order.index("b") < order.index("w")
    # A module used twice: its parameters once, at their first use.
    assert order.count("shared.weight") == 1 and order.count("shared.bias") == 1
    assert order == ["out.bias", "out.weight", "shared.bias", "shared.weight", "b", "w", "a.bias", "a.weight"]
    assert order == eager_ready_order(model, lambda: model(x).square().sum())
    first_uses = [p.first_use for p in ready_order(params)]
    assert first_uses == sorted(first_uses, reverse=True)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_ready_order_transformer(tied):
    model, (idx, targets) = tiny_gpt(tied)
    gm, ex = capture_one(model, idx, targets)
    reducer_params = list(model.named_parameters())  # remove_duplicate: a tied tensor once
    params = find_graph_params(gm, ex, reducer_params)
    order = names(ready_order(params))
    assert order == reference_ready_order(gm, ex, model)
    assert sorted(order) == sorted(n for n, _ in reducer_params) and len(order) == len(set(order))
    assert order[-2:] == ["pos.weight", "tok.weight"]
    if tied:
        assert "head.weight" not in order
        # The tied tensor counts at its first use (the embedding), not at the head.
        tok = next(p for p in params if p.name == "tok.weight")
        assert tok.tensor is model.head.weight
        assert tok.first_use == min(p.first_use for p in params)
    else:
        assert order[0] == "head.weight"
    assert [p.reducer_index for p in params if p.name == "tok.weight"] == [0]


def test_same_parameter_in_two_placeholders_counted_once():
    # A hand-built graph where one parameter arrives through two placeholders.
    w = nn.Parameter(torch.randn(4, 4))
    b = nn.Parameter(torch.randn(4))
    g = fx.Graph()
    x = g.placeholder("x")
    w1 = g.placeholder("w1")
    bias = g.placeholder("bias")
    w2 = g.placeholder("w2")
    h = g.call_function(torch.matmul, (x, w2))  # first use of the tensor: through w2
    h = g.call_function(torch.add, (h, bias))
    h = g.call_function(torch.matmul, (h, w1))
    g.output((h,))
    gm = fx.GraphModule(nn.Module(), g)
    params = find_graph_params(gm, [torch.randn(2, 4), w, b, w], [("w", w), ("b", b)])
    assert sorted(names(params)) == ["b", "w"]
    by_name = {p.name: p for p in params}
    assert by_name["w"].node is w2 and by_name["w"].first_use == 4
    assert names(ready_order(params)) == ["b", "w"]


def test_each_graph_matches_its_parameters_once_and_locates_them_after_blocks_are_shared(
    single_rank_group, monkeypatch
):
    """The graph backend finds which inputs are DDP parameters once per graph, and where they are
    used once, in the graph the strategies get (blocks already calls of one compile)."""
    from bucketwise.compiler import graph_backend

    matched, located = [], []
    real_match, real_locate = graph_backend.match_params, graph_backend.params_in_graph

    def match(gm, example_inputs, named):
        matched.append(gm)
        return real_match(gm, example_inputs, named)

    def locate(gm, inputs):
        params = real_locate(gm, inputs)
        located.append((gm, [str(n.target) for n in gm.graph.nodes], {p.name: p.first_use for p in params}))
        return params

    monkeypatch.setattr(graph_backend, "match_params", match)
    monkeypatch.setattr(graph_backend, "params_in_graph", locate)
    torch._dynamo.reset()
    ddp = DDP(BlocksNet())
    compiled = bucketwise.compile(ddp, backend="aot_eager", strategy="fused", share_blocks=True)
    compiled(torch.randn(4, 8)).backward()
    rep = bucketwise.report(compiled)
    (graph,) = rep.graphs
    assert graph.shared_blocks is not None and "reason" not in graph.shared_blocks, graph.shared_blocks
    assert len(matched) == 1 and len(located) == 1 and located[0][0] is matched[0]
    _, targets, first_use = located[0]
    # Located in the graph as shared: each block's weight first used by the call of its block.
    calls = [i for i, t in enumerate(targets) if "shared_block" in t or "block_call" in t]
    assert len(calls) == 3, targets
    assert [first_use[f"blocks.{k}.0.weight"] for k in range(3)] == calls, (first_use, targets)
    assert sorted(first_use) == sorted(n for n, _ in ddpc.reducer_parameters(ddp))


def test_buffers_and_frozen_parameters_not_counted(single_rank_group):
    model = BNFrozenNet()
    ddp = DDP(copy.deepcopy(model))
    inner = ddp.module
    x = torch.randn(8, 16)
    gm, ex = capture_one(inner, x)
    reducer = ddpc.reducer_parameters(ddp)
    # bucketwise's reducer parameter list is DDP's own, in the same order.
    ddp_params, _ = ddp._build_params_for_reducer()
    assert [p for _, p in reducer] == ddp_params
    params = find_graph_params(gm, ex, reducer)
    found = sorted(names(params))
    assert found == ["bn.bias", "bn.weight", "l0.bias", "l0.weight", "l1.bias", "l1.weight"]
    # Buffers are graph inputs too, but never reducer parameters.
    buffer_ids = {id(b) for b in inner.buffers()}
    assert buffer_ids & {id(v) for v in ex}, "the graph should read the buffers"
    assert not buffer_ids & {id(p.tensor) for p in params}
    # Even if a caller passed every named parameter, frozen ones would be found: the
    # exclusion is the reducer list's job, which the line above checks against DDP.
    assert "frozen.weight" not in [n for n, _ in reducer]


def test_reducer_parameters_match_ddp_tied_and_ignored(single_rank_group):
    model, _ = tiny_gpt(tied=True)
    DDP._set_params_and_buffers_to_ignore_for_model(model, ["blocks.0.fc.weight", "ln_f.bias"])
    ddp = DDP(model)
    reducer = ddpc.reducer_parameters(ddp)
    ddp_params, _ = ddp._build_params_for_reducer()
    assert [p for _, p in reducer] == ddp_params
    got = [n for n, _ in reducer]
    assert "blocks.0.fc.weight" not in got and "ln_f.bias" not in got
    assert got.count("tok.weight") == 1 and "head.weight" not in got


def test_params_inside_checkpoint_found_and_flagged():
    model = CheckpointNet()
    x = torch.randn(4, 16)
    gm, ex = capture_one(model, x)
    assert any("checkpoint" in h for h in higher_order_ops(gm)), higher_order_ops(gm)
    params = find_graph_params(gm, ex, list(model.named_parameters()))
    assert sorted(names(params)) == sorted(n for n, _ in model.named_parameters())
    flagged = {p.name for p in params if p.in_higher_order_op}
    assert flagged == {"block.0.weight", "block.0.bias", "block.2.weight", "block.2.bias"}
    hop = next(
        n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.HigherOrderOperator)
    )
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for p in params:
        if p.in_higher_order_op:
            assert p.first_use == order[hop]
    # Ready order still: out, block (one HOP node: last operand first), inp.
    order_names = names(ready_order(params))
    assert order_names[:2] == ["out.bias", "out.weight"]
    assert order_names[-2:] == ["inp.bias", "inp.weight"]
    assert set(order_names[2:6]) == flagged


def test_unused_parameters_last():
    # A graph that receives parameters it never reads (possible with get_attr or a caller
    # passing them): first_use -1, listed after every used one, in reducer order.
    ps = {n: nn.Parameter(torch.randn(4, 4)) for n in ("u2", "w0", "u1", "w1")}
    g = fx.Graph()
    x = g.placeholder("x")
    nodes = {n: g.placeholder(n) for n in ps}
    h = g.call_function(torch.matmul, (x, nodes["w0"]))
    h = g.call_function(torch.matmul, (h, nodes["w1"]))
    g.output((h,))
    gm = fx.GraphModule(nn.Module(), g)
    reducer = [("w0", ps["w0"]), ("u1", ps["u1"]), ("w1", ps["w1"]), ("u2", ps["u2"])]
    params = find_graph_params(gm, [torch.randn(2, 4), *ps.values()], reducer)
    assert {p.name: p.first_use for p in params if p.first_use < 0} == {"u1": -1, "u2": -1}
    assert names(ready_order(params)) == ["w1", "w0", "u1", "u2"]

    # Dynamo's own graphs: parameters of a module the forward never calls are not lifted.
    class WithUnused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l0 = nn.Linear(8, 8)
            self.unused = nn.Linear(8, 8)
            self.l1 = nn.Linear(8, 8)

        def forward(self, x):
            return self.l1(self.l0(x))

    model = WithUnused()
    gm, ex = capture_one(model, torch.randn(2, 8))
    got = find_graph_params(gm, ex, list(model.named_parameters()))
    assert names(ready_order(got)) == ["l1.bias", "l1.weight", "l0.bias", "l0.weight"]


# --- the plan against DDP's real reducer -----------------------------------------------------


def test_plan_predicts_ddp_rebuilt_buckets(single_rank_group):
    """Eager DDP's reducer rebuilds its buckets from the real gradient-ready order; for an MLP
    that order is the predicted one, so the plan must give the same buckets."""
    torch.manual_seed(0)
    model = mlp(width=48, depth=5, d_in=16, d_out=4)
    ddp = DDP(model, bucket_cap_mb=0.005)  # 5 KiB: every 9 KiB hidden layer closes a bucket
    for _ in range(3):
        ddp(torch.randn(8, 16)).square().mean().backward()
    rebuilt, source = ddpc.reducer_buckets(ddp)
    assert source == "rebuilt", source
    gm, ex = capture_one(model, torch.randn(8, 16))
    params = find_graph_params(gm, ex, ddpc.reducer_parameters(ddp))
    plan = plan_buckets(ready_order(params), BucketCaps.from_ddp(ddp))
    assert len(plan) >= 3
    assert sorted(sorted(p.reducer_index for p in b) for b in plan) == sorted(sorted(b) for b in rebuilt)


# --- split ---------------------------------------------------------------------------------


def _split(gm: fx.GraphModule, ex: Sequence[Any], reducer_params, caps: BucketCaps):
    params = find_graph_params(gm, ex, reducer_params)
    buckets = plan_buckets(ready_order(params), caps)
    used = [p for p in params if p.first_use >= 0]
    split_gm, segments = split_graph(gm, bucket_boundaries(gm, buckets), used)
    return params, buckets, split_gm, segments


def _outputs_and_grads(fn: Callable[..., Any], ex: Sequence[Any], params: Sequence[torch.Tensor]):
    for p in params:
        p.grad = None
    out = fn(*ex)
    out = out[0] if isinstance(out, (tuple, list)) else out
    out.float().square().sum().backward()
    grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return out.detach(), grads


def _check_split(model: nn.Module, args: tuple, caps: BucketCaps, *, min_segments: int):
    gm, ex = capture_one(model, *args)
    original = copy.deepcopy(gm)
    reducer = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params, buckets, split_gm, segments = _split(gm, ex, reducer, caps)
    assert len(segments) >= min_segments, [names(s.params) for s in segments]
    # Segments are the split module's submodules, called in forward order.
    calls = [str(n.target) for n in split_gm.graph.nodes if n.op == "call_module"]
    assert calls == [s.submodule for s in segments]
    # Every used parameter lies in exactly one segment; every bucket lies in one segment.
    where = {p.name: s.index for s in segments for p in s.params}
    assert sorted(where) == sorted(p.name for p in params if p.first_use >= 0)
    for b in buckets:
        assert len({where[p.name] for p in b}) == 1, f"bucket {names(b)} cut across segments"
    # Forward order: a later segment's parameters are all first used later.
    for s0, s1 in zip(segments, segments[1:]):
        if s0.params and s1.params:
            assert max(p.first_use for p in s0.params) < min(p.first_use for p in s1.params)
    # The split graph computes what the original graph computes, forward and backward.
    tensors = [p for _, p in reducer]
    out_ref, grads_ref = _outputs_and_grads(original, ex, tensors)
    out, grads = _outputs_and_grads(split_gm, ex, tensors)
    torch.testing.assert_close(out, out_ref, rtol=1e-6, atol=1e-7)
    for g, r in zip(grads, grads_ref):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-7)
    return gm, split_gm, segments


def test_split_mlp_one_segment_per_bucket():
    model = mlp(width=32, depth=4, d_in=16, d_out=4)
    # 32x32 fp32 = 4 KiB: a 4 KiB cap closes a bucket at every hidden weight; the small
    # output layer (6.*) shares the first bucket with 4.*.
    gm, split_gm, segments = _check_split(
        model, (torch.randn(4, 16),), BucketCaps(first_bytes=4096, bytes=4096), min_segments=3
    )
    assert [sorted(names(s.params)) for s in segments] == [
        ["0.bias", "0.weight"],
        ["2.bias", "2.weight"],
        ["4.bias", "4.weight", "6.bias", "6.weight"],
    ]


def test_split_transformer():
    model, (idx, targets) = tiny_gpt()
    _check_split(model, (idx, targets), BucketCaps(first_bytes=16 * 1024, bytes=16 * 1024), min_segments=4)


def test_split_tied_transformer():
    model, (idx, targets) = tiny_gpt(tied=True)
    _check_split(model, (idx, targets), BucketCaps(first_bytes=16 * 1024, bytes=16 * 1024), min_segments=4)


def test_split_bucket_boundary_between_bias_and_weight():
    # A 1-byte cap makes every parameter its own bucket; bias and weight of one linear share
    # their first user node, so they cannot be separated: one segment holds both buckets.
    model = mlp(width=32, depth=3, d_in=16, d_out=4)
    gm, split_gm, segments = _check_split(
        model, (torch.randn(4, 16),), BucketCaps(first_bytes=1, bytes=1), min_segments=3
    )
    assert len(segments) == 3
    for s in segments:
        assert sorted(names(s.params))[0].split(".")[0] == sorted(names(s.params))[1].split(".")[0]


@pytest.mark.parametrize("cap", [1, 2048, 4096 + 128])
def test_split_never_cuts_inside_checkpoint(cap):
    model = CheckpointNet()
    gm, split_gm, segments = _check_split(
        model, (torch.randn(4, 16),), BucketCaps(first_bytes=cap, bytes=cap), min_segments=2
    )
    hop_names = [h for h in higher_order_ops(gm)]
    assert hop_names
    # The HOP node is whole in exactly one segment, with its body and all its operands.
    holders = []
    for s in segments:
        sub = getattr(split_gm, s.submodule)
        hops = [
            n
            for n in sub.graph.nodes
            if n.op == "call_function" and isinstance(n.target, torch._ops.HigherOrderOperator)
        ]
        if hops:
            holders.append(s)
            for hop in hops:
                body = hop.args[0]
                assert body.op == "get_attr" and isinstance(getattr(sub, str(body.target)), fx.GraphModule)
    assert len(holders) == 1
    flagged = {"block.0.weight", "block.0.bias", "block.2.weight", "block.2.bias"}
    assert flagged <= set(names(holders[0].params))
    # Original graph nodes carry their segment.
    hop = next(
        n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.HigherOrderOperator)
    )
    assert SEGMENT_META_KEY in hop.meta


# --- split + per-segment compile, end to end without a process group -------------------------


class SplitBackend:
    """A torch.compile backend that plans, splits and compiles segments as bucketwise does
    for a DDP graph, with ``named_parameters()`` as the reducer's parameters."""

    def __init__(self, model: nn.Module, caps: BucketCaps, backend: str = "aot_eager", dynamic: bool | None = None):
        self.reducer = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.caps = caps
        self.backend_fn = dc.make_backend(backend, None, None, dynamic)
        self.segments: list[list[str]] = []

    def __call__(self, gm: fx.GraphModule, ex: Sequence[Any]):
        params = find_graph_params(gm, ex, self.reducer)
        buckets = plan_buckets(ready_order(params), self.caps)

        backend_fn = self.backend_fn

        class Pieces:
            def piece(self, g, e, *, label, what, tracing=None):
                return compile_with_fallback(
                    g, e, backend_fn, backend_name="aot_eager", fallback="raise", tracing=tracing
                )

        job = GraphJob(gm=gm, example_inputs=ex, params=params, graph_id=0)
        compiled, segments, outcomes = split_and_compile(job, buckets, Pieces())
        self.segments = [names(s.params) for s in segments]
        assert all(not o.fell_back for o in outcomes)
        return compiled


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("which", ["mlp", "checkpoint", "gpt"])
def test_split_and_compile_matches_eager(which, dynamic):
    torch.manual_seed(0)
    if which == "mlp":
        model = mlp(width=32, depth=4, d_in=16, d_out=4)
        batches = [(torch.randn(b, 16),) for b in (6, 4, 5)]
    elif which == "checkpoint":
        model = CheckpointNet()
        batches = [(torch.randn(b, 16),) for b in (6, 4, 5)]
    else:
        model, _ = tiny_gpt()
        cfg = model.cfg
        batches = [synthetic_tokens(cfg, b, seed=b) for b in (3, 2, 4)]
    ref = copy.deepcopy(model)
    backend = SplitBackend(model, BucketCaps(first_bytes=4096, bytes=4096), dynamic=dynamic)
    compiled = torch.compile(lambda *a: model(*a), backend=backend, dynamic=dynamic)
    for args in batches:
        out = compiled(*args)
        out_ref = ref(*args)
        torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-6)
        out.float().square().sum().backward()
        out_ref.float().square().sum().backward()
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"grad {n}: {m}")
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    assert len(backend.segments) >= 2, backend.segments
