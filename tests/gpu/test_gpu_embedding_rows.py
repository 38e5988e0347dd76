"""The op that builds a gathered embedding gradient is deterministic on CUDA (NOTE [embedding
rows]): every rank must get the same bits from the same gathered rows. Run on the device machines."""

from __future__ import annotations

import pytest
import torch

import bucketwise.distributed.fused.embedding_rows  # noqa: F401  (registers bucketwise::embedding_rows_grad)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("ids", [2048, 16384], ids=["few-ids", "many-ids"])  # ATen's two kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_rows_grad_is_deterministic_on_cuda(ids, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = torch.randn(ids, 768, device="cuda", generator=g).to(dtype)
    index = torch.randint(0, 512, (ids,), device="cuda", generator=g)  # many repeats per row
    first = torch.ops.bucketwise.embedding_rows_grad(rows, index, 50304, -1)
    for _ in range(3):
        assert torch.equal(torch.ops.bucketwise.embedding_rows_grad(rows, index, 50304, -1), first)
    # ATen's own kernel (eager autograd's), not a copy of it.
    assert torch.equal(first, torch.ops.aten.embedding_dense_backward(rows, index, 50304, -1, False))
    if dtype is torch.float32:
        expected = torch.zeros(50304, 768, device="cuda").index_add_(0, index, rows)
        torch.testing.assert_close(first, expected, rtol=1e-5, atol=1e-4)
