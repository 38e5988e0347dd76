"""NOTE [matrix products into the bucket] (_compat/mm_into_bucket.py): a weight gradient that a
matrix product computes is written by the product into its slice of the bucket, not copied there.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch._inductor.utils import run_and_get_code
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.parallel import DistributedDataParallel as DDP

import bucketwise
from bucketwise._compat import mm_into_bucket as mib
from bucketwise._compat.capabilities import products_lowering_checked

pytestmark = pytest.mark.skipif(
    not products_lowering_checked(), reason=f"the lowering is not checked on torch {torch.__version__}"
)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).square().mean()


def _aliases(code: str) -> dict[str, str]:
    """``buf`` -> the buffer it is a ``reinterpret_tensor`` alias of, in Inductor's output code."""
    return dict(re.findall(r"(buf\d+) = reinterpret_tensor\((buf\d+),.*# alias", code))


def test_weight_gradients_are_computed_in_the_bucket_and_equal_eager_ddp(single_rank_group):
    torch.manual_seed(0)
    model = MLP()
    eager, ddp = DDP(model), DDP(copy.deepcopy(model))
    compiled = bucketwise.compile(ddp, strategy="fused")
    x = torch.randn(16, 32)
    _, codes = run_and_get_code(lambda: compiled(x).backward())
    eager(x).backward()
    backward = next(c for c in codes if "all_reduce_" in c)
    reduced = re.findall(r"all_reduce_\.default\((buf\d+)", backward)
    aliases = _aliases(backward)
    into = [b for b in re.findall(r"extern_kernels\.mm\(.*out=(buf\d+)\)", backward) if aliases.get(b) in reduced]
    # The three weights' gradients (products) are written into the one all-reduced bucket.
    assert len(reduced) == 1 and len(into) == 3, backward
    for (name, p), q in zip(eager.module.named_parameters(), ddp.module.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)


def _bucket_graph(shapes, *, used_twice=False):
    """make_fx of a bucket built as ``fused`` builds it: ``cat`` of flattened gradients (a product
    for each (m, k, n) shape, else a plain tensor of that many elements), then its all-reduce."""

    def f(*tensors):
        parts, i = [], 0
        for s in shapes:
            if isinstance(s, tuple):
                prod = torch.mm(tensors[i], tensors[i + 1])
                parts.append(prod.reshape(-1))
                if used_twice:
                    parts.append(prod.sum().reshape(-1))
                i += 2
            else:
                parts.append((tensors[i] * 2).reshape(-1))
                i += 1
        flat = torch.cat(parts)
        group = dist.group.WORLD.group_name
        return torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(flat, "sum", group))

    args = []
    for s in shapes:
        args += [torch.randn(s[0], s[1]), torch.randn(s[1], s[2])] if isinstance(s, tuple) else [torch.randn(s)]
    return make_fx(f, tracing_mode="fake")(*args).graph


def _ops(graph) -> list[str]:
    return [str(n.target) for n in graph.nodes if n.op == "call_function"]


def test_the_pass_rewrites_products_at_aligned_offsets_only(single_rank_group):
    graph = _bucket_graph([4, (8, 3, 4), (8, 3, 4)])
    assert mib.products_into_buckets(graph) == 2
    assert "bucketwise.cat_mm.default" in _ops(graph) and "aten.mm.default" not in _ops(graph)
    # 3 floats first: the first product's slice starts 12 bytes in, so it is left to the copy.
    graph = _bucket_graph([3, (8, 3, 4), 1, (8, 3, 4)])
    assert mib.products_into_buckets(graph) == 1
    assert _ops(graph).count("aten.mm.default") == 1


def test_a_product_used_elsewhere_is_left_alone(single_rank_group):
    graph = _bucket_graph([4, (8, 3, 4)], used_twice=True)
    assert mib.products_into_buckets(graph) == 0


def test_off_where_gemms_are_autotuned(single_rank_group):
    from torch._inductor import config

    graph = _bucket_graph([4, (8, 3, 4)])
    with config.patch(max_autotune=True):
        assert mib.products_into_buckets(graph) == 0
