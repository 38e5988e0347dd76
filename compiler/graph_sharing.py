"""The shared-blocks step of one graph's compile (``GraphBackend.__call__``): whether and how its
identical blocks share one compile, decided from the compiled object's ``Decision`` and, for
``share_blocks="auto"`` without CUDA graphs, the blocks' estimated cost (NOTE [sharing by cost])."""

from __future__ import annotations

import collections
from typing import Any, Sequence

import torch
import torch.fx as fx

from .._compat import aot
from .._compat import dynamo as dc
from .._compat import inductor as ci
from ..partitioners.param_usage import ParamInput
from .blocks import Sharing, share_blocks
from .blocks.calls import BlockCalls, is_block_call
from .blocks.find import BlockBuckets, CostRule, device_cost
from .decision import Decision


def share_in_graph(
    backend: Any, gm: fx.GraphModule, example_inputs: Sequence[Any], choice: Decision, matched: list[ParamInput]
) -> tuple[Sharing | None, str | None]:
    """Identical blocks of ``backend``'s graph share one compile (NOTE [one compile per block]);
    under ``fused`` each reduces its own parameters' bucket (NOTE [a bucket per block]). Returns
    what was shared, or ``None`` and why not (``None``: sharing is off)."""
    cfg = backend.config
    if not backend.sharing.enabled:
        return None, None
    chosen = choice.sharing
    if not chosen.enabled:
        return None, chosen.reason
    patches = dc.inductor_config_patches(cfg.mode, cfg.options, cfg.dynamic) if cfg.capabilities.inductor else {}
    buckets = None
    if choice.plain_buckets:
        tensors = collections.Counter(id(a) for a in example_inputs if isinstance(a, torch.Tensor))
        own = frozenset(
            p.node
            for p in matched
            if p.node.op == "placeholder" and p.tensor.requires_grad and tensors[id(p.tensor)] == 1
        )
        buckets = BlockBuckets(spec=choice.spec, params=own)
    called = any(is_block_call(node) for node in gm.graph.nodes)
    # The blocks run inside the graph's own CUDA graphs (Inductor's or bucketwise's), never in
    # their own; their inputs' layouts are checked at each block's first call, not at every
    # call (host time: a block's graph is called once per block).
    patches = {**patches, "triton.cudagraphs": False, "size_asserts": False}
    if buckets is not None:  # the blocks' backward gathers their gradients into a bucket
        patches.update(ci.bucket_safe_patches())  # NOTE [reductions into bucket views]
    aot.start_compile_workers(cfg.capabilities, example_inputs)  # NOTE [compile workers from the start]
    cost = None
    if chosen.by_cost:
        cost, why = _cost_rule(backend, example_inputs)
        if cost is None:
            return None, why
    sharing, unshared = share_blocks(
        gm, example_inputs, backend=cfg.capabilities, config_patches=patches, buckets=buckets, cost=cost
    )
    calls = backend.block_calls
    if sharing is not None:
        sharing.dynamo = True if called else _why_inlined(calls)
    elif not called and calls is not None and calls.off is not None and unshared is not None:
        unshared = f"{unshared} (Dynamo traced every block: {calls.off})"
    return sharing, unshared


def _cost_rule(backend: Any, example_inputs: Sequence[Any]) -> tuple[CostRule | None, str | None]:
    """How ``share_blocks="auto"`` decides for this graph without CUDA graphs (NOTE [sharing by
    cost]), or why its blocks stay whole: the estimate is of Inductor's blocks on one GPU."""
    devices = {a.device for a in example_inputs if isinstance(a, torch.Tensor)}
    inductor = backend.config.capabilities.inductor
    if not inductor or len(devices) != 1 or next(iter(devices)).type != "cuda":
        why = (
            "share_blocks='auto' shares blocks without CUDA graphs where a block's call, estimated for "
            "Inductor's kernels on one GPU, hides behind them; this graph "
            + ("compiles with another backend" if not inductor else "does not run on one GPU")
            + ". Pass share_blocks=True for a shorter first step all the same"
        )
        return None, why
    device, note = device_cost(next(iter(devices)))
    if note is not None:
        backend.report.note(f"share_blocks='auto': {note}")
    return CostRule(device=device, report=backend.report), None


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
