"""Stable compile-cache keys for what bucketwise puts into compiled graphs (NOTE [compile cache
keys]); the restart itself (a second compile over the same cache) is tested in test_report.py."""

from __future__ import annotations

import pickle

import torch
import torch.fx as fx

from bucketwise._compat import collectives as cc
from bucketwise._compat import dynamo as dc
from bucketwise.distributed.fused.cache_keys import comm_pass_key, source_key, traced_call_targets
from bucketwise.distributed.fused.sync import CommSpec, insert_bucket_syncs
from bucketwise.partitioners.param_usage import find_graph_params


def test_scheduler_pass_pickles_with_the_hash_of_its_source():
    passes = cc.comm_overlap_options(comm_pass_key())["reorder_for_compute_comm_overlap_passes"]
    sink = passes[-1]
    assert sink.uuid() == source_key(cc) and sink.uuid().startswith("bucketwise-")
    assert pickle.dumps(sink) == pickle.dumps(
        cc.comm_overlap_options(comm_pass_key())["reorder_for_compute_comm_overlap_passes"][-1]
    )
    assert pickle.dumps(sink) != pickle.dumps(cc.SinkWaitsPass("bucketwise-other"))
    assert sink.key.encode() in pickle.dumps(sink)


class _TwoMatmuls(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.ones(4, 4))
        self.b = torch.nn.Parameter(torch.ones(4, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.a @ self.b


def test_traced_call_targets_name_what_the_fused_pass_inserts():
    model = _TwoMatmuls()
    gm = fx.symbolic_trace(model)
    params = find_graph_params(gm, [], list(model.named_parameters()))
    insert_bucket_syncs(gm, [[p] for p in params], CommSpec(group="0", world_size=1))
    targets = {
        n.target for n in gm.graph.nodes if n.op == "call_function" and n.target.__module__.startswith("bucketwise")
    }
    names = traced_call_targets()
    assert targets and all(f"{t.__module__}.{t.__name__}" in names for t in targets)
    assert len(set(names.values())) == 1


def test_cacheable_calls_options_keep_the_users_options():
    user = {"max_autotune": False, "unsafe_marked_cacheable_functions": {"mine.fn": "1"}}
    merged = dc.cacheable_calls_options({"bucketwise.x.f": "k"}, user)
    assert merged["max_autotune"] is False
    assert merged["unsafe_marked_cacheable_functions"] == {"mine.fn": "1", "bucketwise.x.f": "k"}
    assert user["unsafe_marked_cacheable_functions"] == {"mine.fn": "1"}, "the user's dict is not modified"


def test_a_shared_block_graph_is_keyed_by_the_blocks_code():
    """A graph calling ``bucketwise::shared_block`` compiles under options keyed by the source of
    ``compiler/blocks.py``: its autograd formula decides what the cached backward is handed."""
    from bucketwise.compiler import blocks
    from bucketwise.distributed.fused.cache_keys import source_key

    assert blocks.cache_targets() == {"bucketwise.compiler.blocks.shared_block": source_key(blocks)}


class _Block(torch.nn.Module):
    def __init__(self, act: str) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return x + (torch.tanh(y) if self.act == "tanh" else torch.sigmoid(y))


class _Stack(torch.nn.Module):
    def __init__(self, act: str) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(act) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def _split_cache_run(act: str) -> tuple[list, list[torch.Tensor], list[torch.Tensor]]:
    """A new compile of a fresh model (Dynamo's caches reset): the block split cache's answers,
    and the compiled and eager gradients."""
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP

    import bucketwise

    torch._dynamo.reset()
    torch.manual_seed(0)
    net = _Stack(act)
    eager = copy.deepcopy(net)
    compiled = bucketwise.compile(DDP(net), strategy="fused", backend="aot_eager", share_blocks=True)
    x = torch.randn(4, 8)
    compiled(x).backward()
    eager(x).backward()
    shared = [g["shared_blocks"] for g in bucketwise.report(compiled).to_dict()["graphs"] if g.get("shared_blocks")]
    assert shared and shared[0]["count"] >= 2 and shared[0]["compiles"] == 1, shared
    return (
        shared[0]["split_cache"],
        [p.grad for p in net.parameters()],
        [p.grad for p in eager.parameters()],
    )


def test_a_shared_block_split_is_kept_and_found_again_by_a_new_compile(
    single_rank_group, tmp_path, monkeypatch, caplog
):
    """NOTE [block split cache]: the second compile of the same block over the same cache reads
    AOTAutograd's split instead of making it, and trains the same; a damaged entry is made
    again with a warning; another computation misses; with torch's caches off, nothing is used."""
    from bucketwise._compat import graph_cache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    first, grads, eager = _split_cache_run("tanh")
    assert first == ["miss"], first
    for g, e in zip(grads, eager):
        torch.testing.assert_close(g, e)
    entries = list((tmp_path / "cache" / graph_cache.ARTIFACT_TYPE).glob("*/*"))
    assert len(entries) == 1, entries

    again, grads_again, _ = _split_cache_run("tanh")
    assert again == ["hit"], again
    for g, e in zip(grads_again, eager):
        torch.testing.assert_close(g, e)

    entries[0].write_bytes(b"not a pickle")
    with caplog.at_level("WARNING"):
        damaged, grads_damaged, _ = _split_cache_run("tanh")
    assert damaged == ["miss"], damaged
    assert any("did not load" in r.getMessage() for r in caplog.records), caplog.text
    for g, e in zip(grads_damaged, eager):
        torch.testing.assert_close(g, e)
    assert _split_cache_run("tanh")[0] == ["hit"]

    other, grads_other, eager_other = _split_cache_run("sigmoid")
    assert other == ["miss"], other
    for g, e in zip(grads_other, eager_other):
        torch.testing.assert_close(g, e)
    assert len(list((tmp_path / "cache" / graph_cache.ARTIFACT_TYPE).glob("*/*"))) == 2

    with torch._inductor.config.patch(force_disable_caches=True):
        off, _, _ = _split_cache_run("tanh")
    assert off == ["not used: torch's compile caches are off"], off
