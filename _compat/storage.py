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


def poison(t: torch.Tensor, message: str) -> None:
    """Make every tensor on ``t``'s storage raise ``message`` when read or written from now on
    (the storage lets go of its memory; another owner's memory is not freed). Inductor's cudagraph
    trees do the same to the outputs a later replay overwrote. Bound by CUDA builds of torch only
    (absent from the CPU wheels, where no CUDA graph exists); run on 2.15.0+cu132 (a storage over
    another's memory: its views raise, the owner's memory untouched) and, on a GPU, by
    tests/gpu/test_gpu_cudagraphs.py."""
    torch._C._set_storage_data_ptr_access_error_msg(t.untyped_storage()._cdata, message)
