"""The shared-blocks step of one graph's compile (``GraphBackend.__call__``): its identical
blocks share one compile where its plan says so (NOTE [one plan per graph]), under
``share_blocks="auto"`` without CUDA graphs only where a block's estimated call hides behind its
kernels (NOTE [sharing by cost])."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Sequence

import torch
import torch.fx as fx

from .._compat import aot
from .._compat import dynamo as dc
from .._compat import inductor as ci
from ..partitioners.param_usage import ParamInput
from .blocks import Sharing, share_blocks
from .blocks.calls import BlockCalls, is_block_call
from .blocks.find import BlockBuckets, KeptWhole, find_block_run
from .plan import GraphPlan


@dataclasses.dataclass(frozen=True)
class Unshared:
    """Why a graph's blocks compile with it; ``blocks``: the container and count the report names
    (``None``: nothing to name); ``host_time``: only for the host time a shared call costs."""

    reason: str
    blocks: tuple[str, int] | None = None
    host_time: bool = False


def share_in_graph(
    backend: Any, gm: fx.GraphModule, example_inputs: Sequence[Any], plan: GraphPlan, matched: list[ParamInput]
) -> tuple[Sharing | None, Unshared | None]:
    """Identical blocks of ``backend``'s graph share one compile (NOTE [one compile per block]);
    under ``fused`` each reduces its own parameters' bucket (NOTE [a bucket per block]). Returns
    what was shared, or ``None`` and why not (``None``: not asked to share)."""
    cfg = backend.config
    chosen = plan.sharing
    if not chosen.enabled:
        # Said of a graph only where it has blocks to share.
        if chosen.reason is None or find_block_run(gm)[0] is None:
            return None, None
        return None, Unshared(chosen.reason, backend.repeated, chosen.host_time)
    patches = dc.inductor_config_patches(cfg.mode, cfg.options, cfg.dynamic) if cfg.capabilities.inductor else {}
    buckets = None
    decision = plan.decision
    if decision.plain_buckets:
        tensors = collections.Counter(id(a) for a in example_inputs if isinstance(a, torch.Tensor))
        own = frozenset(
            p.node
            for p in matched
            if p.node.op == "placeholder" and p.tensor.requires_grad and tensors[id(p.tensor)] == 1
        )
        buckets = BlockBuckets(spec=decision.spec, params=own)
    called = any(is_block_call(node) for node in gm.graph.nodes)
    # The blocks run inside the graph's own CUDA graphs (Inductor's or bucketwise's), never in
    # their own; their inputs' layouts are checked at each block's first call, not at every
    # call (host time: a block's graph is called once per block).
    patches = {**patches, "triton.cudagraphs": False, "size_asserts": False}
    if buckets is not None:  # the blocks' backward gathers their gradients into a bucket
        patches.update(ci.bucket_safe_patches())  # NOTE [reductions into bucket views]
    aot.start_compile_workers(cfg.capabilities, example_inputs)  # NOTE [compile workers from the start]
    try:
        sharing, unshared = share_blocks(
            gm, example_inputs, backend=cfg.capabilities, config_patches=patches, buckets=buckets, cost=plan.cost
        )
    except KeptWhole as exc:
        return None, Unshared(str(exc), (exc.container, exc.count), host_time=True)
    calls = backend.block_calls
    if sharing is not None:
        sharing.dynamo = True if called else _why_inlined(calls)
    elif not called and calls is not None and calls.off is not None and unshared is not None:
        unshared = f"{unshared} (Dynamo traced every block: {calls.off})"
    return sharing, Unshared(unshared) if unshared is not None else None


def _why_inlined(calls: BlockCalls | None) -> str:
    """Why Dynamo traced every block of a graph whose blocks are shared (NOTE [Dynamo calls a block])."""
    if calls is None:
        return (
            "blocks become one call each under bucketwise.compile with the backends inductor and aot_eager (not "
            "torch.compile(..., backend='bucketwise'), not another backend)"
        )
    if calls.off is not None:
        return calls.off
    return (
        "an argument of the blocks is not a tensor, a number, a string, None or a list or tuple of them (a cache "
        "object: pass use_cache=False in training)"
    )
