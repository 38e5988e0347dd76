"""Tensor and storage identity: use counts and aliases of memory a CUDA graph owns
(cudagraphs/runner.py). Checked on torch 2.11.0 (device machines) and 2.13.0 (CI); the same
calls back Inductor's cudagraph trees on both."""

from __future__ import annotations

import torch


def tensor_use_count(t: torch.Tensor) -> int:
    """References to a tensor's TensorImpl (a saved-for-backward slot holds one)."""
    return int(t._use_count())


def storage_cdata(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def storage_use_count(cdata: int) -> int:
    """References to a storage (every tensor viewing it holds one)."""
    return int(torch._C._storage_Use_Count(cdata))


def storage_at(data_ptr: int, nbytes: int, device: torch.device) -> torch.UntypedStorage:
    """A storage over memory someone else owns (no deleter): freeing it frees nothing. The
    memory must outlive every tensor made from it (a CUDA graph's pool does)."""
    return torch._C._construct_storage_from_data_pointer(data_ptr, device, nbytes)


def tensor_at(
    storage: torch.UntypedStorage,
    offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    dtype: torch.dtype,
) -> torch.Tensor:
    """A tensor viewing ``storage`` (offset in elements of ``dtype``)."""
    return torch.empty((0,), dtype=dtype, device=storage.device).set_(storage, offset, size, stride)
