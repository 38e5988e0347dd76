"""NOTE [matrix products into the bucket]: Inductor builds a bucket's flat buffer with ``cat``,
which lets a pointwise or reduction kernel write straight into its slice but copies an extern
kernel's output (``mm``: a fixed layout) into it, one more pass over every weight gradient. So a
post-grad pass turns a bucket's ``cat`` whose inputs include ``reshape(mm(a, b))`` (the product
used only there, its slice 16-byte aligned) into ``cat_mm``, whose lowering hands each product a
2-D view of the buffer at its offset as ``out=``. Off under Inductor's C++ wrapper (not checked)
and where GEMMs are autotuned (the product keeps its Triton templates). Inductor's IR classes
(``ConcatKernel``, ``SliceView``, ``ReinterpretView``, ``NonOwningLayout``, ``ExternKernelOut``)
checked on torch 2.13.0, 2.14.1 and 2.15.0 (CPU; ``capabilities.products_lowering_checked``). CPU
graphs only: on a GPU the copy is one short kernel and the products' writes into the bucket are
not measured there yet, so GPU buckets keep the copy.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch
import torch.fx as fx

from . import ops
from .capabilities import products_lowering_checked

_ALIGN_BYTES = 16
"""A product's slice starts here (BLAS kernels want aligned output)."""


def _segments(order: Sequence[int], tensors: Sequence[torch.Tensor]) -> list[Any]:
    plain = sum(1 for k in order if k >= 0)
    out = []
    for k in order:
        if k >= 0:
            out.append(tensors[k])
        else:
            j = plain + 2 * (-k - 1)
            out.append((tensors[j], tensors[j + 1]))
    return out


def _kernel(order: list[int], tensors: list[torch.Tensor]) -> torch.Tensor:
    parts = [
        s.reshape(-1) if isinstance(s, torch.Tensor) else torch.mm(*s).reshape(-1) for s in _segments(order, tensors)
    ]
    return torch.cat(parts)


def _fake(order: list[int], tensors: list[torch.Tensor]) -> torch.Tensor:
    segs = _segments(order, tensors)
    n = sum(s.numel() if isinstance(s, torch.Tensor) else s[0].shape[0] * s[1].shape[1] for s in segs)
    return tensors[0].new_empty(n)


@functools.lru_cache(maxsize=None)
def cat_mm() -> Any:
    """The operator, defined and lowered on first use."""
    op = ops.define("bucketwise::cat_mm", "(int[] order, Tensor[] tensors) -> Tensor", kernel=_kernel, fake=_fake)
    from torch._inductor import ir
    from torch._inductor.lowering import register_lowering
    from torch._inductor.virtualized import V

    @register_lowering(op, type_promotion_kind=None)
    def _lower(order: list[int], tensors: list[Any]) -> Any:
        segs = _segments(order, tensors)
        sizes = [s.get_numel() if not isinstance(s, tuple) else s[0].get_size()[0] * s[1].get_size()[1] for s in segs]
        first = tensors[0]
        device, dtype = first.get_device(), first.get_dtype()
        kernel = ir.ConcatKernel(
            name=None, layout=ir.FixedLayout(device=device, dtype=dtype, size=[sum(sizes)]), inputs=[]
        )
        storage = ir.StorageBox(kernel)
        offset = 0
        for seg, n in zip(segs, sizes):
            if isinstance(seg, tuple):
                a, b = (ir.ExternKernel.realize_input(t) for t in seg)
                m, k = a.get_size()[0], b.get_size()[1]
                view = ir.ReinterpretView(
                    data=storage,
                    layout=ir.FixedLayout(device=device, dtype=dtype, size=[m, k], stride=[k, 1], offset=offset),
                )
                kernel.inputs.append(
                    ir.ExternKernelOut(
                        layout=ir.NonOwningLayout(view),
                        inputs=[a, b],
                        python_kernel_name="extern_kernels.mm",
                        cpp_kernel_name="at::mm_out",
                        op_overload=torch.ops.aten.mm.out,
                    )
                )
            else:
                flat = ir.View.create(seg, [n]) if len(seg.get_size()) != 1 else seg
                kernel.inputs.append(
                    ir.ConcatKernel.realize_into(flat, ir.SliceView.create(storage, 0, offset, offset + n, clamp=False))
                )
            offset += n
        kernel.name = V.graph.register_buffer(kernel)
        kernel.inputs = ir.ConcatKernel.unwrap_storage(kernel.inputs)
        V.graph.register_operation(kernel)
        return ir.TensorBox(storage)

    return op


_VIEWS = (torch.ops.aten.reshape.default, torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def _val(node: Any) -> Any:
    """The fake tensor a post-grad node computes, ``None`` if it has none (or is no node)."""
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def products_into_buckets(graph: fx.Graph) -> int:
    """In place: each flat bucket ``cat`` (feeding an all-reduce) with product inputs becomes
    ``cat_mm``; returns how many products now write into their bucket."""
    from torch._inductor import config

    # The C++ wrapper is not checked; autotuned GEMMs keep their Triton templates.
    if not products_lowering_checked() or config.cpp_wrapper or config.max_autotune or config.max_autotune_gemm:
        return 0
    done = 0
    for node in list(graph.find_nodes(op="call_function", target=torch.ops.aten.cat.default)):
        inputs, out = node.args[0], _val(node)
        if (
            out is None
            or out.dim() != 1
            or out.device.type != "cpu"
            or any(_val(x) is None for x in inputs)
            or not any(u.target is torch.ops._c10d_functional.all_reduce.default for u in node.users)
        ):
            continue
        plain, products, order, offset = [], [], [], 0
        for x in inputs:
            mm = x.args[0] if x.target in _VIEWS and len(x.users) == 1 else None
            if (
                isinstance(mm, fx.Node)
                and mm.target is torch.ops.aten.mm.default
                and len(mm.users) == 1
                and getattr(_val(mm), "dtype", None) == out.dtype
                and (offset * out.element_size()) % _ALIGN_BYTES == 0
            ):
                products.append((x, mm))
                order.append(-len(products))
            else:
                order.append(len(plain))
                plain.append(x)
            offset += _val(x).numel()
        if not products:
            continue
        pairs = [t for _, mm in products for t in mm.args[:2]]
        with graph.inserting_before(node):
            new = graph.call_function(cat_mm(), (order, plain + pairs))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        for x, mm in products:
            graph.erase_node(x)
            graph.erase_node(mm)
        done += len(products)
    return done
