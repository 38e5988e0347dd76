"""Whether a shared block's call hides behind its kernels, estimated from its graphs.

NOTE [sharing by cost]: a shared block's call costs the host more than the same block inside the
whole graph (its own launches, allocations and checks, every call) and the GPU nothing. Where the
GPU's time for the block covers that cost, the step keeps its time; where not, the step waits on
the host for every block. So ``share_blocks="auto"`` without CUDA graphs, on a GPU, shares where
the host's time per call is at most ``HOST_SHARE_LIMIT`` of the GPU's, both estimated from the
block's forward and backward graphs: the GPU's from their FLOPs at the device's matmul rate for
their dtype plus the bytes they take and return at its bandwidth, the host's from their op count.
The rates are per-device constants (docs/performance.md names the runs they come from), so the
same model on the same kind of GPU gets the same plan on every rank and every restart.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any, Mapping

import torch
import torch.fx as fx

from .._compat import aot

HOST_SHARE_LIMIT = 0.6
"""Share where a block's call costs the host at most this fraction of the GPU's time for it: a
margin for the host's other work in a step and its noise between runs."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceCost:
    """What one kind of GPU does per second, and what its host spends per op of a shared block."""

    name: str
    matmul_flops: Mapping[torch.dtype, float]
    """FLOP/s of the matmuls and attention of a block in each dtype."""
    bytes_per_s: float
    host_s_per_op: float
    """The host's time per op of a shared block's call (Inductor's launches and the call's checks)."""


H200 = DeviceCost(
    name="NVIDIA H200",
    matmul_flops={torch.bfloat16: 5.0e14, torch.float16: 5.0e14, torch.float32: 5.0e13},
    bytes_per_s=3.5e12,
    host_s_per_op=8.3e-6,
)
KNOWN = {H200.name: H200}


def device_cost(device: torch.device) -> tuple[DeviceCost, str | None]:
    """The constants of ``device``'s kind, and a note where none were measured for it: then the
    H200's, whose faster matmuls underestimate another GPU's time, so that fewer blocks share."""
    name = torch.cuda.get_device_name(device)
    if name in KNOWN:
        return KNOWN[name], None
    return H200, f"no sharing constants were measured on {name}: the {H200.name}'s are used"


@dataclasses.dataclass(frozen=True)
class BlockCost:
    """One block's call (forward and backward), estimated from its graphs."""

    flops: float
    bytes: float
    ops: int
    gpu_ms: float
    host_ms: float

    @property
    def ratio(self) -> float:
        return self.host_ms / self.gpu_ms if self.gpu_ms > 0 else math.inf

    def to_dict(self) -> dict[str, Any]:
        return {
            "gflop": round(self.flops / 1e9, 3),
            "mib": round(self.bytes / 2**20, 3),
            "ops": self.ops,
            "gpu_ms": round(self.gpu_ms, 4),
            "host_ms": round(self.host_ms, 4),
        }


def estimate(forward: fx.GraphModule, backward: fx.GraphModule, device: DeviceCost) -> BlockCost:
    """The cost of one call of a block compiled as ``forward`` and ``backward`` (AOTAutograd's
    graphs, their nodes carrying fake values)."""
    flops = gpu_s = nbytes = 0.0
    ops = 0
    for gm in (forward, backward):
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "output"):
                for value in _tensors(node.meta.get("val") if node.op == "placeholder" else node.args[0]):
                    nbytes += value.numel() * value.element_size()
            elif node.op == "call_function" and not aot.aliases_an_input(node) and node.target is not operator.getitem:
                ops += 1
                count, dtype = aot.node_flops(node)
                flops += count
                gpu_s += count / device.matmul_flops.get(dtype, device.matmul_flops[torch.float32])
    gpu_s += nbytes / device.bytes_per_s
    return BlockCost(flops=flops, bytes=nbytes, ops=ops, gpu_ms=gpu_s * 1e3, host_ms=ops * device.host_s_per_op * 1e3)


class KeptWhole(Exception):
    """A block whose shared call would cost the host more than the GPU hides: its message says why."""


@dataclasses.dataclass(frozen=True)
class CostRule:
    """``share_blocks="auto"`` without CUDA graphs, on a GPU, for one graph (NOTE [sharing by cost])."""

    device: DeviceCost
    report: Any
    """The compiled object's ``Report``: a refusal is noted there, for the host time only."""

    def check(self, forward: fx.GraphModule, backward: fx.GraphModule) -> BlockCost:
        """The block's estimated cost; raises :class:`KeptWhole` where it is not to be shared."""
        cost = estimate(forward, backward, self.device)
        why = refusal(cost, self.device)
        if why is not None:
            raise KeptWhole(why)
        return cost

    def refused(self, container: str, count: int, why: str) -> None:
        self.report.blocks_unshared(container, count, reason=why, host_time=True)


def refusal(cost: BlockCost, device: DeviceCost) -> str | None:
    """Why the blocks stay with the whole graph, or ``None``: share them."""
    if cost.ratio <= HOST_SHARE_LIMIT:
        return None
    return (
        f"share_blocks='auto' estimated a shared block's call on {device.name}: the host {cost.host_ms:.3f} ms to "
        f"issue its {cost.ops} ops, the GPU {cost.gpu_ms:.3f} ms to run its {cost.flops / 1e9:.1f} GFLOP "
        f"({cost.ratio:.2f}x, more than {HOST_SHARE_LIMIT}x), so the step would wait on the host for every block. "
        "Pass share_blocks=True for a shorter first step all the same, or cudagraphs=True, whose replays share "
        "the blocks at no host cost"
    )


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, fx.Node):
        value = value.meta.get("val")
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []
