"""Which compiled graphs replay from CUDA graphs: per compile (:func:`resolve`) and per graph
(:func:`capture_blockers`; a blocked graph runs uncaptured, with the reason in the report).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
import torch.fx as fx

from .._compat import dynamo as dc
from .._compat.capabilities import Capabilities

# Ops that read a tensor's value on the host (a device-to-host copy + synchronisation) or whose
# output shape depends on tensor values: a capture would bake one step's answer into the graph.
HOST_SYNC_OPS = frozenset(
    {
        "aten._local_scalar_dense",
        "aten.item",
        "aten.is_nonzero",
        "aten.equal",
        "aten.nonzero",
        "aten.nonzero_static",
        "aten.masked_select",
        "aten.unique",
        "aten._unique",
        "aten._unique2",
        "aten.unique_dim",
        "aten.unique_consecutive",
        "aten.bincount",
        "aten.repeat_interleave",
        "aten._assert_async",
    }
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Decision:
    """Whether a compile wraps its graphs in CUDA graphs, and why not if it does not."""

    enabled: bool
    reason: str | None = None


def resolve(
    requested: bool | str, *, cuda: bool, backend: Capabilities, mode: str | None, dynamic: bool | None
) -> Decision:
    """``ValueError`` for requests that mean nothing (``True`` with Inductor's own CUDA graphs or
    another backend); a disabled decision with a reason where the request is moot (no CUDA)."""
    if requested is False:
        return Decision(enabled=False)
    if mode == "reduce-overhead":
        if requested is True:
            raise ValueError(
                "cudagraphs=True and mode='reduce-overhead' both ask for CUDA graphs; use cudagraphs=True "
                "(bucketwise's wrapper) or mode='reduce-overhead' (Inductor's cudagraph trees), not both"
            )
        return Decision(enabled=False, reason="mode='reduce-overhead': Inductor's cudagraph trees are in use")
    if not cuda:
        return Decision(enabled=False, reason="no CUDA device: CUDA graphs are a no-op")
    if not backend.inductor:
        if requested is True:
            raise ValueError(
                f"cudagraphs=True wraps Inductor-compiled graphs; backend {backend.name!r} is not 'inductor' "
                "(use backend='inductor' or cudagraphs=False)"
            )
        return Decision(enabled=False, reason=f"backend {backend.name!r}: only Inductor graphs are wrapped")
    if requested == "auto" and dynamic is True:
        return Decision(enabled=False, reason="auto: dynamic=True (shapes change between calls)")
    return Decision(enabled=True)


def _devices(value: Any) -> set[torch.device]:
    vals = value if isinstance(value, (list, tuple)) else [value]
    return {v.device for v in vals if isinstance(v, torch.Tensor)}


def mutated_placeholders(gm: fx.GraphModule) -> dict[int, str]:
    """Placeholder index -> the op that writes into it (in-place ops, ``copy_`` back)."""
    index = {node: i for i, node in enumerate(gm.graph.find_nodes(op="placeholder"))}
    out: dict[int, str] = {}
    for node in gm.graph.nodes:
        for value in dc.written_args(node) if node.op == "call_function" else ():
            if value in index:
                out.setdefault(index[value], dc.op_name(node.target))
    return out


def capture_blockers(gm: fx.GraphModule, example_inputs: Sequence[Any], *, device_type: str = "cuda") -> list[str]:
    """Why replaying ``gm`` would be wrong or impossible (empty: capturable); a tensor off
    ``device_type`` blocks. Writes into inputs are checked when recording (:func:`mutated_placeholders`)."""
    reasons: list[str] = []
    for i, value in enumerate(example_inputs):
        if isinstance(value, torch.Tensor) and value.device.type != device_type:
            reasons.append(f"input {i} is a {value.device.type} tensor")
            break
    for node in gm.graph.nodes:
        if node.op == "call_function":
            name = dc.op_name(node.target)
            if name in HOST_SYNC_OPS:
                reasons.append(f"{name} synchronises with the host (node {node.name})")
                break
        val = node.meta.get("val")
        if node.op != "output" and dc.has_unbacked_symbols(val):
            reasons.append(f"data-dependent shape at node {node.name}")
            break
        if node.op == "call_function" and any(d.type != device_type for d in _devices(val)):
            reasons.append(f"node {node.name} ({dc.op_name(node.target)}) makes a tensor off the {device_type} device")
            break
    return reasons
