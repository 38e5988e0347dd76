"""The table gradient of gathered embedding rows on CUDA: sorted, then summed per id, with no
device-to-host sync (NOTE [rows without a sync]).

NOTE [rows without a sync]: ATen's CUDA ``embedding_dense_backward`` is deterministic, but above
3072 ids it sorts them, counts the distinct ids and reads that count back to the host
(``num_of_segments.item()``) to size its next launches: a device-to-host sync in the middle of
every backward. Until then the host is queueing work far ahead of the GPU; after it, the host
launches the rest of the step into an empty queue, and a step whose host time is close to its
GPU time loses the difference (gpt-medium on one H200: 71 ms against 47 ms). Here every shape is
static: the ids are sorted (a stable sort, so equal ids keep their order), and one Triton
program per (sorted position, column block) checks whether its position starts a run of equal
ids; if so it sums the run's rows in order, ``TILE`` rows at a time with a fixed reduction
tree, in fp32, and writes the table row. The sum of every table row is computed by one program
in a fixed order, so the same rows and ids give the same bits on every rank and every run.
Programs that do not start a run return at once. A run of ``k`` equal ids takes ``k / TILE``
sequential steps in its program: a batch of one repeated id is the slow case (16384 ids: 1024
steps), a real vocabulary's frequent tokens a few dozen.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 16
"""Rows of one run summed per step (a fixed reduction tree: the order is the same every time)."""
BLOCK_D = 128
"""Columns per program."""


@triton.jit
def _sum_runs(
    sorted_ids,
    order,
    rows,
    out,
    n,
    dim,
    padding_idx,
    row_stride,
    out_stride,
    TILE: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    in_row = cols < dim
    idx = tl.load(sorted_ids + i)
    prev = tl.load(sorted_ids + i - 1, mask=i > 0, other=-1)
    if (idx != prev) & (idx != padding_idx):
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        start = i
        full = True
        while full:
            pos = start + tl.arange(0, TILE)
            same = tl.load(sorted_ids + pos, mask=pos < n, other=-1) == idx
            src = tl.load(order + pos, mask=same, other=0)
            tile = tl.load(rows + src[:, None] * row_stride + cols[None, :], mask=same[:, None] & in_row[None, :])
            acc += tl.sum(tile.to(tl.float32), axis=0)
            start += TILE
            full = tl.sum(same.to(tl.int32), axis=0) == TILE
        tl.store(out + idx.to(tl.int64) * out_stride + cols, acc.to(out.dtype.element_ty), mask=in_row)


def table_grad(rows: torch.Tensor, ids: torch.Tensor, num_weights: int, padding_idx: int) -> torch.Tensor:
    """``embedding_dense_backward(rows, ids, num_weights, padding_idx)`` on CUDA, deterministic
    and without a device-to-host sync (NOTE [rows without a sync]). ``padding_idx``: -1 for none."""
    rows = rows.reshape(-1, rows.shape[-1]).contiguous()
    ids = ids.reshape(-1)
    n, dim = rows.shape
    out = rows.new_zeros((num_weights, dim))
    if n == 0 or dim == 0:
        return out
    sorted_ids, order = torch.sort(ids, stable=True)
    grid = (n, triton.cdiv(dim, BLOCK_D))
    _sum_runs[grid](
        sorted_ids, order, rows, out, n, dim, padding_idx, rows.stride(0), out.stride(0), TILE=TILE, BLOCK_D=BLOCK_D
    )
    return out
