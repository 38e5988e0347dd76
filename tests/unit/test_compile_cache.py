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
from bucketwise.partitioners.param_usage import match_params, params_in_graph


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
    params = params_in_graph(gm, match_params(gm, [], list(model.named_parameters())))
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
    the modules that decide what the cached backward is handed: the op's autograd formula
    (``compiler/blocks/__init__.py``), the layout of what the forward saves and the bucket a block
    reduces (``compiler/blocks/graphs.py``)."""
    from bucketwise.compiler import blocks
    from bucketwise.compiler.blocks import graphs
    from bucketwise.distributed.fused.cache_keys import source_key

    key = blocks.cache_targets()["bucketwise.compiler.blocks.shared_block"]
    assert key == source_key(blocks, graphs)
    assert key not in (source_key(blocks), source_key(graphs))
