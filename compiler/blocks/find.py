"""Repeated blocks in a Dynamo graph: where each starts and ends (a node's outermost numbered
``nn_module_stack`` entry), which are the same computation, whether sharing pays."""

from __future__ import annotations

import dataclasses
import math
import operator
import re
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx

from ..._compat import aot
from ..._compat import autograd as agc
from ...distributed.fused.sync import CommSpec
from ...partitioners.regions import outside_regions, transform_regions
from .calls import opaque_key

Block = tuple[tuple, tuple[fx.Node, ...], list[fx.Node]]  # a block's signature, inputs and nodes
_NUMBERED = re.compile(r"^(.+?)(?:\.(\d+)|\[(\d+)\])$")  # ``layers.3`` or ``layers[3]``


@dataclasses.dataclass(frozen=True)
class BlockRun:
    """Blocks of one module list (``container``: ``L['self'].model.layers``), in graph order:
    the graph positions of each block's first node and of the last block's last node."""

    container: str
    block_class: str
    starts: tuple[int, ...]
    end: int

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def name(self) -> str:  # without Dynamo's frame prefix: ``model.layers``
        return re.sub(r"^[A-Z]\['[^']*'\]\.?", "", self.container) or self.container


def find_block_run(gm: fx.GraphModule) -> tuple[BlockRun | None, str]:
    """The run of repeated blocks to share compiles over, or ``None`` and why there is none."""
    seen: dict[str, dict[int, list[int]]] = {}
    classes: dict[str, set[str]] = {}
    for pos, node in enumerate(gm.graph.nodes):
        stack = (node.meta.get("nn_module_stack") or {}).values() if node.op.startswith("call_") else ()
        for qualified, cls in stack:  # the outermost numbered module the node belongs to
            if m := _NUMBERED.match(str(qualified)):
                seen.setdefault(m.group(1), {}).setdefault(int(m.group(2) or m.group(3)), []).append(pos)
                classes.setdefault(m.group(1), set()).add(getattr(cls, "__qualname__", str(cls)))
                break
    if not seen:
        return None, "no numbered submodules (an nn.ModuleList of blocks) in the graph"
    parent = max(seen, key=lambda p: len(seen[p]))
    blocks = seen[parent]
    if len(blocks) < 2:
        return None, f"{parent} has {len(blocks)} block(s) in this graph"
    if len(classes[parent]) != 1:
        return None, f"{parent} holds blocks of {len(classes[parent])} classes"
    indices = sorted(blocks)
    if indices != list(range(indices[0], indices[0] + len(indices))):
        return None, f"{parent}: blocks {indices} are not consecutive in this graph"
    spans = [(min(blocks[i]), max(blocks[i])) for i in indices]
    if any(start <= end for (_, end), (start, _) in zip(spans, spans[1:])):
        return None, f"{parent}: the blocks' nodes interleave in the graph"
    regions = transform_regions(gm)
    starts = tuple(outside_regions(s, regions) for s, _ in spans)
    if list(starts) != [s for s, _ in spans]:
        return None, f"{parent}: a torch.func transform spans a block boundary"
    return BlockRun(parent, next(iter(classes[parent])), starts, spans[-1][1]), ""


def piece_of(run: BlockRun, position: int) -> int:
    """0 before the first block, ``k + 1`` in block ``k`` (up to the next), ``len(run) + 1`` after."""
    if position < run.starts[0]:
        return 0
    if position > run.end:
        return len(run) + 1
    return sum(1 for s in run.starts if s <= position)


def block_parts(gm: fx.GraphModule, run: BlockRun) -> list[list[fx.Node]]:
    """Each block's nodes, in graph order; a ``get_attr`` (a checkpointed body) goes with its reader."""
    nodes = list(gm.graph.nodes)
    piece = {node: piece_of(run, pos) for pos, node in enumerate(nodes)}
    for node in nodes:
        if node.op == "get_attr" and len(readers := {piece[u] for u in node.users}) == 1:
            piece[node] = readers.pop()
    parts: list[list[fx.Node]] = [[] for _ in range(len(run))]
    for node in nodes:
        if 1 <= piece[node] <= len(run) and node.op not in ("placeholder", "output"):
            parts[piece[node] - 1].append(node)
    return parts


def mode_switch_across(gm: fx.GraphModule, run: BlockRun) -> str | None:
    """Why an autocast region open at a block's start, or a grad-mode switch, keeps them unshared."""
    depth = 0
    starts = set(run.starts)
    for pos, node in enumerate(gm.graph.nodes):
        if pos in starts and depth:
            return "an autocast or grad-mode region spans the blocks (entered before a block starts)"
        name = str(getattr(node.target, "__name__", node.target)) if node.op == "call_function" else ""
        depth += {"_enter_autocast": 1, "_exit_autocast": -1}.get(name, 0)
        if name == "_set_grad_enabled" and run.starts[0] <= pos <= run.end:
            return "the blocks switch grad mode"
    return None


def fake_values(gm: fx.GraphModule, example_inputs: Sequence[Any], fake_mode: Any) -> dict[fx.Node, Any]:
    """A fake value of every node: Dynamo's own, placeholders' from the example inputs."""
    out: dict[fx.Node, Any] = {}
    for node, value in zip(gm.graph.find_nodes(op="placeholder"), example_inputs):
        if isinstance(value, torch.Tensor) and not aot.is_fake(value):
            value = fake_mode.from_tensor(value, static_shapes=True)
        out[node] = value
    for node in gm.graph.nodes:
        out.setdefault(node, node.meta.get("example_value", node.meta.get("val")))
    return out


def invariant_inputs(calls: list[tuple[fx.Node, ...]], values: dict[fx.Node, Any]) -> tuple[int, ...]:
    """The gradient-free inputs all ``calls`` of one block share (NOTE [computed once before the blocks])."""
    return tuple(
        i
        for i, node in enumerate(calls[0])
        if all(ins[i] is node for ins in calls)
        and isinstance(values[node], torch.Tensor)
        and not values[node].requires_grad
    )


@dataclasses.dataclass(frozen=True)
class BlockBuckets:
    """``fused``: how gradients are reduced, and the DDP parameters a shared block may reduce."""

    spec: CommSpec
    params: frozenset[fx.Node]


def reduced_inputs(
    repeated: list[Block], values: dict[fx.Node, Any], buckets: BlockBuckets | None
) -> tuple[dict[tuple, tuple[int, ...]], bool | str | None]:
    """Per signature, the ``buckets.params`` the ``repeated`` blocks read only inside (NOTE [a bucket
    per block]); and ``True``, or why no block reduces its own (``None`` without ``buckets``)."""
    if buckets is None:
        return {}, None
    reduced: dict[tuple, tuple[int, ...]] = {}
    for signature, ins, part in repeated:
        inside = set(part)
        at = tuple(i for i, node in enumerate(ins) if node in buckets.params and all(u in inside for u in node.users))
        if reduced.setdefault(signature, at) != at:
            return {}, "the same block reads DDP parameters at other inputs in another place of the graph"
    dtypes = {values[ins[i]].dtype for signature, ins, _ in repeated for i in reduced[signature]}
    if len(dtypes) > 1 and buckets.spec.comm_dtype is None:
        return {}, f"the blocks' parameters have several dtypes ({sorted(map(str, dtypes))})"
    if not any(reduced.values()):
        return {}, "no DDP parameter is read only inside one block"
    return reduced, True


def piece_signature(gm: fx.GraphModule, inputs: Sequence[Any]) -> tuple:
    """Its inputs' layout and its nodes by position: equal signatures, the same function."""
    values = tuple(
        ("tensor", tuple(v.shape), tuple(v.stride()), str(v.dtype), str(v.device), v.requires_grad)
        if isinstance(v, torch.Tensor)
        else ("value", type(v).__name__, repr(v))
        for v in inputs
    )
    return values, _graph_key(gm)


def _graph_key(gm: fx.GraphModule) -> tuple:
    index = {node: i for i, node in enumerate(gm.graph.nodes)}
    rows = []
    for node in gm.graph.nodes:
        called = opaque_key(node)  # a block call: what its block computes, not its target
        fn = getattr(gm, str(node.target)) if node.op in ("get_attr", "call_module") else node.target
        if node.op == "get_attr":
            rows.append(("get_attr", _graph_key(fn) if isinstance(fn, fx.GraphModule) else ("object", id(fn))))
        elif called is not None:
            rows.append(("opaque", called[0], _arg_key(called[1], index)))
        else:
            if node.op == "call_module":
                target = _graph_key(fn)
            elif node.op == "call_function":
                target = (str(getattr(fn, "__module__", "")), str(getattr(fn, "__qualname__", "")), repr(fn))
            else:
                target = str(fn) if node.op == "call_method" else None
            rows.append((node.op, target, _arg_key(node.args, index), _arg_key(node.kwargs, index)))
    return tuple(rows)


def _arg_key(arg: Any, index: dict[fx.Node, int]) -> Any:
    if isinstance(arg, fx.Node):
        return ("node", index[arg])
    if isinstance(arg, (tuple, list)):
        return (type(arg).__name__, tuple(_arg_key(a, index) for a in arg))
    if isinstance(arg, dict):
        return ("dict", tuple((k, _arg_key(v, index)) for k, v in arg.items()))
    if isinstance(arg, slice):
        return ("slice", _arg_key((arg.start, arg.stop, arg.step), index))
    return (type(arg).__qualname__, repr(arg))  # a number, string, dtype, device, ... by its type and repr


# NOTE [sharing by cost]: a shared block's call costs the host more than the block inside the whole
# graph (its own launches, allocations, checks); where the GPU's time does not cover that, the step
# waits on the host. So ``share_blocks="auto"`` on a GPU without CUDA graphs shares where the host's
# time per call is at most ``HOST_SHARE_LIMIT`` of the GPU's, estimated from the block's graphs (op
# count; FLOPs and bytes at per-device rates, docs/performance.md): the same on every rank and restart.

HOST_SHARE_LIMIT = 0.6  # a margin for the host's other work and its noise


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceCost:
    """What one kind of GPU does per second (matmul FLOPs per dtype, bytes), its host per op."""

    name: str
    matmul_flops: Mapping[torch.dtype, float]
    bytes_per_s: float
    host_s_per_op: float


H200 = DeviceCost(
    name="NVIDIA H200",
    matmul_flops={torch.bfloat16: 5.0e14, torch.float16: 5.0e14, torch.float32: 5.0e13},
    bytes_per_s=3.5e12,
    host_s_per_op=8.3e-6,
)


def device_cost(device: torch.device) -> tuple[DeviceCost, str | None]:
    """``device``'s constants; else the H200's (fewer blocks share) and a note saying so."""
    name = torch.cuda.get_device_name(device)
    note = f"no sharing constants were measured on {name}: the {H200.name}'s are used"
    return H200, None if name == H200.name else note


@dataclasses.dataclass(frozen=True)
class BlockCost:
    """One block's call (forward and backward), estimated from its graphs."""

    flops: float
    bytes: float
    ops: int
    gpu_ms: float
    host_ms: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "gflop": round(self.flops / 1e9, 3),
            "mib": round(self.bytes / 2**20, 3),
            "ops": self.ops,
            "gpu_ms": round(self.gpu_ms, 4),
            "host_ms": round(self.host_ms, 4),
        }


def estimate(forward: fx.GraphModule, backward: fx.GraphModule, device: DeviceCost) -> BlockCost:
    flops = gpu_s = nbytes = 0.0
    ops = 0
    for gm in (forward, backward):
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "output"):
                given = node.meta.get("val") if node.op == "placeholder" else node.args[0]
                values = fx.node.map_arg(given, lambda n: n.meta.get("val"))
                nbytes += sum(t.numel() * t.element_size() for t in agc.tensor_leaves(values))
            elif node.op == "call_function" and not aot.aliases_an_input(node) and node.target is not operator.getitem:
                ops += 1
                count, dtype = aot.node_flops(node)
                flops += count
                gpu_s += count / device.matmul_flops.get(dtype, device.matmul_flops[torch.float32])
    gpu_s += nbytes / device.bytes_per_s
    return BlockCost(flops=flops, bytes=nbytes, ops=ops, gpu_ms=gpu_s * 1e3, host_ms=ops * device.host_s_per_op * 1e3)


class KeptWhole(Exception):
    """Blocks kept whole: their shared call would cost the host too much (``share_blocks`` names them)."""

    container = ""
    count = 0


def refusal(cost: BlockCost, device: DeviceCost) -> str | None:
    ratio = cost.host_ms / cost.gpu_ms if cost.gpu_ms > 0 else math.inf
    if ratio <= HOST_SHARE_LIMIT:
        return None
    return (
        f"share_blocks='auto' estimated a shared block's call on {device.name}: the host {cost.host_ms:.3f} ms to "
        f"issue its {cost.ops} ops, the GPU {cost.gpu_ms:.3f} ms to run its {cost.flops / 1e9:.1f} GFLOP "
        f"({ratio:.2f}x, more than {HOST_SHARE_LIMIT}x), so the step would wait on the host for every block. "
        "Pass share_blocks=True for a shorter first step all the same, or cudagraphs=True, whose replays share "
        "the blocks at no host cost"
    )
