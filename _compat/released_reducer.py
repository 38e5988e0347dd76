"""DDP's bucket buffers released under ``fused`` and rebuilt where needed (private DDP and
reducer attributes: ``_build_params_for_reducer``, ``_ddp_init_helper``, ``_comm_hooks``,
``_register_comm_hook``). Checked on torch 2.11.0 (device machines) and 2.13.0 (CI)."""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from .ddp import reducer_parameters, sparse_gradient_flags, uses_python_reducer

log = logging.getLogger(__name__)

# NOTE [released reducer]: DDP's reducer holds bucket buffers, a copy of every gradient, for the
# module's life; under ``fused`` it is idle and nothing reads them. Once ``fused`` is confirmed,
# bucketwise destroys the reducer (and its logger) and puts in a stand-in answering the one call
# DDP's idle forward makes (``_rebuild_buckets()``). Anything else (``join()`` after a rank joined,
# a later comm hook, logging data) first rebuilds the real reducer as DDP's ``__setstate__`` does.
# A fresh reducer equals the idle one, so ranks that rebuild it at the same step agree.

_RELEASED_KEY = "_bucketwise_released_reducer"


class _ReleasedReducer:
    """``ddp.reducer`` and ``ddp.logger`` while released: answers ``_rebuild_buckets()``, any other
    attribute rebuilds the real object first."""

    def __init__(self, ddp: DDP, role: str) -> None:
        self.__dict__["_ddp"] = weakref.ref(ddp)
        self.__dict__["_role"] = role

    def _rebuild_buckets(self) -> bool:
        if self._role == "reducer":
            return False
        return self.__getattr__("_rebuild_buckets")()

    def __getattr__(self, name: str) -> Any:
        ddp = self._ddp()
        if ddp is None:
            raise AttributeError(f"{name}: the DDP module this reducer belonged to is gone")
        rebuild_reducer(ddp, why=f"DDP's {self._role}.{name} was used")
        return getattr(getattr(ddp, self._role), name)

    def __repr__(self) -> str:
        return f"<DDP {self._role} released by bucketwise (rebuilt on first use)>"


def reducer_bytes(ddp: DDP) -> int:
    """Bytes of the reducer's dense bucket buffers: one element per dense reducer parameter."""
    flags = sparse_gradient_flags(ddp)
    return sum(p.numel() * p.element_size() for (_, p), sparse in zip(reducer_parameters(ddp), flags) if not sparse)


def reducer_released(ddp: DDP) -> bool:
    return isinstance(getattr(ddp, "reducer", None), _ReleasedReducer)


def release_reducer(ddp: DDP) -> int:
    """The bucket buffers' bytes freed (NOTE [released reducer]); 0 where none, or no C++ reducer."""
    if not isinstance(getattr(ddp, "reducer", None), dist.Reducer) or uses_python_reducer(ddp):
        return 0
    freed = reducer_bytes(ddp)
    ddp.__dict__[_RELEASED_KEY] = True
    ddp.reducer = _ReleasedReducer(ddp, "reducer")
    ddp.logger = _ReleasedReducer(ddp, "logger")
    return freed


def rebuild_reducer(ddp: DDP, *, why: str) -> None:
    """As DDP's ``__setstate__`` does, then the module's comm hooks and static-graph setting."""
    if not reducer_released(ddp):
        return
    parameters, expect_sparse_gradient = ddp._build_params_for_reducer()
    names = ddp._build_debug_param_to_name_mapping(parameters)
    ddp._ddp_init_helper(parameters, expect_sparse_gradient, names, ddp.static_graph)
    for hook, state in getattr(ddp, "_comm_hooks", None) or []:
        ddp.logger._set_comm_hook_name(hook.__qualname__)
        dist._register_comm_hook(ddp.reducer, state, hook)
    if ddp.static_graph:
        ddp.reducer._set_static_graph()
        ddp.logger._set_static_graph()
    ddp._has_rebuilt_buckets = False
    log.info("bucketwise: DDP's reducer rebuilt (%s); its bucket buffers are allocated again", why)


def wants_released_reducer(ddp: DDP) -> bool:
    """bucketwise released this module's reducer once (it is released again after a rebuild)."""
    return bool(ddp.__dict__.get(_RELEASED_KEY))
