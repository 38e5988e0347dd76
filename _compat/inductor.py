"""Inductor defects and limits that change what bucketwise's graphs compute or can hold, each with
the torch releases it was checked on.

NOTE [reductions into bucket views]: ``fused`` (and NOTE [a bucket per block]) has Inductor
compute each gradient straight into its slice of a flat bucket built with ``cat``. Inductor's
mix-order reduction (``triton.mix_order_reduction``, default on since torch 2.10) fuses a wide
enough norm layer's backward and, on torch 2.10 to 2.14, finishes its weight and bias gradients
by binding a new tensor instead of writing into the bucket, so the all-reduce sends stale memory
(pytorch/pytorch#193061, fixed in torch 2.15). Where torch has the defect, compiles that gather
gradients into a bucket turn it off, the report says so, and ``fused`` refuses a request for it.
"""

from __future__ import annotations

from typing import Any

import torch

from .capabilities import FIXED_IN, MIX_ORDER_REDUCTION, reductions_into_views_lost

__all__ = ["FIXED_IN", "MIX_ORDER_REDUCTION", "reductions_into_views_lost"]


def bucket_safe_patches() -> dict[str, Any]:
    """Inductor config patches for a compile that computes gradients into a bucket's views."""
    return {MIX_ORDER_REDUCTION: False} if reductions_into_views_lost() else {}


def bucket_safe_note() -> str:
    """The report's note where :func:`bucket_safe_patches` applies."""
    return (
        f"Inductor's mix-order reduction off in graphs that reduce gradients into buckets: torch "
        f"{torch.__version__} loses its norm-layer gradients computed into a bucket (pytorch/pytorch#193061, "
        f"fixed in torch {FIXED_IN}); the norm layers' backward takes two kernels instead of one "
        "(NOTE [reductions into bucket views])"
    )


# NOTE [collectives the C++ wrapper cannot call]: with Inductor's C++ wrapper, an operator without
# a C shim is called back in Python through ``custom_op_wrapper``, which does not take the
# arguments of two collectives ``fused`` may trace: ``_c10d_functional.all_reduce_coalesced_``
# (the shared blocks' reductions grouped, NOTE [block reductions grouped]) and the embedding
# rows' gather (NOTE [embedding rows]): ``NotImplementedError: arg type Any is not yet supported by
# custom_op_wrapper`` while compiling the backward, on torch 2.13.0 (CPU, 1 and 2 gloo ranks). So
# there the blocks reduce one bucket each and tables are all-reduced like any gradient, and the
# report says so. The plain all-reduce of a bucket has a C shim.
_CPP_WRAPPER = "Inductor's C++ wrapper (options['cpp_wrapper'] or TORCHINDUCTOR_CPP_WRAPPER=1)"
_SEE = "(NOTE [collectives the C++ wrapper cannot call])"
CPP_WRAPPER_UNGROUPED = (
    f"shared blocks' all-reduces one per block, not grouped: {_CPP_WRAPPER} cannot call the coalesced "
    f"all-reduce that groups them {_SEE}"
)
CPP_WRAPPER_NO_ROWS = (
    f"embedding tables all-reduced like any gradient, not gathered as rows: {_CPP_WRAPPER} cannot "
    f"call the rows' gather {_SEE}"
)
