"""NOTE [block reductions grouped] (compiler/blocks/graphs.py): the shared blocks'
all-reduces, grouped by the fused rule's sizes in the order the backward issues them."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from bucketwise.compiler import blocks
from bucketwise.compiler.blocks.graphs import group_block_reductions

MIB = 2**20
AR = torch.ops._c10d_functional.all_reduce.default


def _backward(block_mib: list[float], dtypes: list[torch.dtype] | None = None) -> fx.Graph:
    """A backward as the blocks leave it: per block its flat buffer, all-reduced and waited for."""
    g = fx.Graph()
    outs = []
    for i, mib in enumerate(block_mib):
        saved = g.placeholder(f"saved{i}")
        call = g.call_function(blocks.SHARED_BLOCK_BACKWARD, (0, [saved]))
        flat = g.call_function(operator.getitem, (call, 1))
        dtype = dtypes[i] if dtypes else torch.float32
        flat.meta["val"] = torch.empty(int(mib * MIB) // dtype.itemsize, dtype=dtype, device="meta")
        reduced = g.call_function(AR, (flat, "sum", "0"))
        reduced.meta["val"] = flat.meta["val"]
        outs.append(g.call_function(torch.ops._c10d_functional.wait_tensor.default, (reduced,)))
    g.output(tuple(outs))
    return g


def _groups(g: fx.Graph) -> list[int]:
    """Blocks per collective, in graph order."""
    sizes = []
    for n in g.nodes:
        if n.target is AR:
            sizes.append(1)
        elif n.target is torch.ops._c10d_functional.all_reduce_coalesced.default:
            sizes.append(len(n.args[0]))
    return sizes


def test_blocks_group_by_the_fused_sizes_and_each_wait_reads_its_own_block():
    g = _backward([10] * 8)  # 80 MiB, cap 25: caps of 25, 25, 25 MiB; a group closes at 30 MiB
    group_block_reductions(g, producer=blocks.SHARED_BLOCK_BACKWARD.name(), floor_bytes=25 * MIB)
    g.lint()
    assert _groups(g) == [3, 3, 2]
    waits = next(iter(g.find_nodes(op="output"))).args[0]
    # Block i's wait still reads block i's reduced buffer: its item of its group's call.
    read = [(w.args[0].args[0].args[0], w.args[0].args[1]) for w in waits[:6]]
    flats = [n for n in g.nodes if n.target is operator.getitem and n.args[0].target is blocks.SHARED_BLOCK_BACKWARD]
    assert [inputs[i] for inputs, i in read] == flats[:6]
    assert waits[7].args[0].args[0].args[0][1] is flats[7]


def test_blocks_as_large_as_the_cap_keep_a_collective_each():
    g = _backward([30] * 4)
    group_block_reductions(g, producer=blocks.SHARED_BLOCK_BACKWARD.name(), floor_bytes=25 * MIB)
    assert _groups(g) == [1, 1, 1, 1]


def test_all_reduces_of_other_producers_are_left_alone():
    g = _backward([1] * 3)
    group_block_reductions(g, producer="bucketwise::something_else", floor_bytes=25 * MIB)
    assert _groups(g) == [1, 1, 1]
    group_block_reductions(g, producer=blocks.SHARED_BLOCK_BACKWARD.name(), floor_bytes=25 * MIB)
    assert _groups(g) == [3]


def test_a_coalesced_call_holds_one_dtype():
    g = _backward([1] * 4, [torch.float32, torch.float32, torch.bfloat16, torch.bfloat16])
    group_block_reductions(g, producer=blocks.SHARED_BLOCK_BACKWARD.name(), floor_bytes=25 * MIB)
    assert _groups(g) == [2, 2]
