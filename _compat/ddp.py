"""Private DistributedDataParallel attributes: its forward, configuration, reducer and join()
(comm hooks: ``ddp_hooks.py``; the released reducer: ``released_reducer.py``). Checked on torch
2.11.0 (device machines) and 2.13.0 (CI). bucketwise keeps DDP's ``_pre_forward`` and
``_post_forward`` and swaps only the ``module(...)`` call between them for a compiled one."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import weakref
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

log = logging.getLogger(__name__)


def is_ddp(obj: Any) -> bool:
    return isinstance(obj, DDP)


# --- forward -----------------------------------------------------------------------------


def pre_forward(ddp: DDP, args: tuple, kwargs: dict, buffers: BufferBroadcast) -> tuple[tuple, dict]:
    """DDP's own ``_pre_forward``: reducer prepare, bucket rebuild, buffer sync (``buffers``'s,
    where it takes DDP's place: NOTE [buffer broadcast]), input moves."""
    with buffers.instead_of_ddp():
        return ddp._pre_forward(*args, **kwargs)


# NOTE [buffer broadcast]: to find the buffers it broadcasts before a syncing forward, DDP walks
# every module again (``_assign_modules_buffers``): host time every step. bucketwise sends the same
# buffers from the same rank at the same point, and walks again only when a pass over the dicts it
# found shows a submodule or buffer added, removed or replaced (``.to()``/``.half()`` included).
# Torch's global registration hooks would be cheaper, but a model that builds modules in its
# forward runs them inside the compiled frame, and Dynamo guards on them: a recompile every step.
# Where DDP's broadcast is not the plain one (a buffer comm hook, ``join()``) DDP does it itself.


class BufferBroadcast:
    """DDP's buffer broadcast before the forward for one DDP module (NOTE [buffer broadcast])."""

    def __init__(self, ddp: DDP) -> None:
        self._ddp = weakref.ref(ddp)
        self._sizes: list[tuple[dict, int]] = []
        """Every module's ``_modules`` and ``_buffers`` dict with its length when last found."""
        self._entries: list[tuple[dict, str, Any]] = []
        """Every submodule and buffer as ``(dict, name, value)``, when last found."""

    @contextlib.contextmanager
    def instead_of_ddp(self) -> Iterator[None]:
        """Around DDP's ``_pre_forward``: its buffer sync is this object's while inside."""
        ddp = self._ddp()
        if ddp is None or not ddp._check_sync_bufs_pre_fwd() or hasattr(ddp, "buffer_hook") or join_enabled(ddp):
            yield
            return
        self._broadcast(ddp)
        ddp.require_forward_param_sync = False  # DDP's _pre_forward then skips _sync_buffers
        try:
            yield
        finally:
            ddp.require_forward_param_sync = True

    def _broadcast(self, ddp: DDP) -> None:
        if world_size(ddp) == 1:
            return
        if not self._unchanged():
            self._find(ddp)
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(ddp.modules_buffers)):
            dist._broadcast_coalesced(ddp.process_group, ddp.modules_buffers, ddp.broadcast_bucket_size, 0)

    def _unchanged(self) -> bool:
        """No submodule or buffer added, removed or replaced since :meth:`_find`."""
        return (
            bool(self._sizes)
            and all(len(d) == n for d, n in self._sizes)
            and all(d.get(name) is value for d, name, value in self._entries)
        )

    def _find(self, ddp: DDP) -> None:
        ddp._assign_modules_buffers()  # DDP's own list, as its _sync_buffers makes it
        sizes, entries = [], []
        for module in ddp.module.modules():
            for d in (module._modules, module._buffers):
                sizes.append((d, len(d)))
                entries += [(d, name, value) for name, value in d.items()]
        self._sizes, self._entries = sizes, entries


def post_forward(ddp: DDP, output: Any) -> Any:
    """DDP's own ``_post_forward``: prepare_for_backward, unused-parameter sink."""
    return ddp._post_forward(output)


def route_forward(ddp: DDP, compiled: Any) -> None:
    """``ddp(...)`` runs ``compiled.forward`` (NOTE [registered backend takes over the DDP
    forward]), Dynamo kept out: DDP's pre/post-forward run eagerly, as in DDP's own forward."""
    ddp.__dict__["forward"] = torch.compiler.disable(compiled.forward)


def set_owner(ddp: Any, owner: Any) -> None:
    """What compiles this module's graphs, with its ``report`` and ``config``, for ``report()``."""
    ddp.__dict__["_bucketwise_compiled"] = owner


def owner_of(ddp: Any) -> Any | None:
    """What ``set_owner`` recorded for ``ddp``, or None."""
    return getattr(ddp, "__dict__", {}).get("_bucketwise_compiled")


def uses_python_reducer(ddp: DDP) -> bool:
    return bool(getattr(ddp, "_use_python_reducer", False))


# --- configuration -----------------------------------------------------------------------


def bucket_caps(ddp: DDP) -> tuple[int, int, list[int]]:
    """``(first_bucket_bytes, bucket_bytes, per_bucket_bytes_list)`` as the reducer's rebuild
    uses them. Read from ``bucket_bytes_cap``/``bucket_bytes_cap_default``, which torch 2.11 and
    2.13 both expose (2.13 keeps the real ones in ``_bucket_config``)."""
    cap = int(ddp.bucket_bytes_cap)
    default = bool(getattr(ddp, "bucket_bytes_cap_default", False))
    first = int(dist._DEFAULT_FIRST_BUCKET_BYTES) if default else cap
    per_bucket = [int(c) for c in getattr(ddp, "bucket_bytes_cap_list", None) or []]
    return first, cap, per_bucket


def default_bucket_caps(ddp: DDP) -> bool:
    """No ``bucket_cap_mb`` nor ``bucket_cap_mb_list`` given."""
    return bool(getattr(ddp, "bucket_bytes_cap_default", False)) and not getattr(ddp, "bucket_bytes_cap_list", None)


def ignored_names(ddp: DDP) -> set[str]:
    return set(getattr(ddp, "parameters_to_ignore", ()) or ())


def find_unused_parameters(ddp: DDP) -> bool:
    return bool(ddp.find_unused_parameters)


def static_graph(ddp: DDP) -> bool:
    return bool(getattr(ddp, "static_graph", False))


def process_group(ddp: DDP):
    return ddp.process_group


def world_size(ddp: DDP) -> int:
    return dist.get_world_size(ddp.process_group)


# --- the reducer's parameters and buckets ------------------------------------------------


def _reducer_entries(ddp: DDP) -> list[tuple[str, torch.nn.Parameter, torch.nn.Module]]:
    """``(name, parameter, owning module)`` per reducer parameter, in reducer index order, by
    ``DDP._build_params_for_reducer``'s rule (tied parameters keep their first name)."""
    ignore = ignored_names(ddp)
    seen: set[int] = set()
    out: list[tuple[str, torch.nn.Parameter, torch.nn.Module]] = []
    for mod_name, mod in ddp.module.named_modules():
        for p_name, p in mod.named_parameters(recurse=False):
            fqn = f"{mod_name}.{p_name}" if mod_name else p_name
            # DDP checks f"{module_name}.{param_name}" (a leading "." at the root).
            if not p.requires_grad or fqn in ignore or f"{mod_name}.{p_name}" in ignore:
                continue
            if id(p) in seen:
                continue
            seen.add(id(p))
            out.append((fqn, p, mod))
    return out


def reducer_parameters(ddp: DDP) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters DDP's reducer owns, in reducer index order, with their names."""
    return [(name, p) for name, p, _ in _reducer_entries(ddp)]


def _produces_sparse_gradient(module: torch.nn.Module) -> bool:
    """DDP's rule (``_build_params_for_reducer``): sparse ``Embedding``/``EmbeddingBag`` modules."""
    return isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and bool(module.sparse)


def sparse_gradient_flags(ddp: DDP) -> list[bool]:
    """Per reducer parameter: does DDP expect a sparse gradient (a bucket of its own) for it?"""
    return [_produces_sparse_gradient(mod) for _, _, mod in _reducer_entries(ddp)]


def _parse_index_groups(text: str) -> list[list[int]]:
    return [[int(i) for i in group.split()] for group in text.split(",") if group.strip()]


def reducer_buckets(ddp: DDP) -> tuple[list[list[int]] | None, str]:
    """The reducer's buckets as lists of reducer parameter indices, and their source:
    ``"rebuilt"`` (from the reducer's logging data), ``"pending"`` (a rebuild is still to come;
    buckets None) or ``"initial"`` (no rebuild will happen: the construction-time assignment)."""
    data = ddp._get_ddp_logging_data()
    rebuilt = data.get("rebuilt_per_bucket_param_indices")
    if rebuilt:
        return _parse_index_groups(str(rebuilt)), "rebuilt"
    if will_rebuild(ddp):
        return None, "pending"
    return initial_buckets(ddp), "initial"


def will_rebuild(ddp: DDP) -> bool:
    """The reducer rebuilds its buckets after the first iteration (``should_rebuild_buckets``)."""
    return static_graph(ddp) or not find_unused_parameters(ddp)


def initial_buckets(ddp: DDP) -> list[list[int]]:
    params = [p for _, p in reducer_parameters(ddp)]
    first, cap, per_bucket = bucket_caps(ddp)
    if per_bucket:
        limits = per_bucket
    elif will_rebuild(ddp):
        limits = [sys.maxsize]
    elif first < cap:
        limits = [first, cap]
    else:
        limits = [cap]
    indices, _ = dist._compute_bucket_assignment_by_size(params, limits, sparse_gradient_flags(ddp))
    return [list(b) for b in reversed(indices)]


def compute_bucket_assignment(tensors: list[torch.Tensor], limits: list[int], order: list[int]) -> list[list[int]]:
    """DDP's own bucket assignment over ``tensors`` in gradient-ready order (``order``: indices)."""
    sparse = [False] * (max(order) + 1 if order else 0)
    indices, _ = dist._compute_bucket_assignment_by_size(tensors, limits, sparse, order)
    return [list(b) for b in indices]


def process_group_usable(ddp: DDP) -> str | None:
    """None if DDP's process group can still be used, else a reason."""
    if not dist.is_available() or not dist.is_initialized():
        return "torch.distributed is not initialized (was destroy_process_group() called?)"
    pg = ddp.process_group
    try:
        dist.get_world_size(pg)
    except Exception as exc:  # noqa: BLE001 - any failure means the group is gone
        return f"the DDP module's process group is no longer valid ({exc})"
    return None


def has_rebuilt_buckets(ddp: DDP) -> bool:
    return bool(getattr(ddp, "_has_rebuilt_buckets", False))


def fixed_buckets(ddp: DDP) -> list[list[int]] | None:
    """The reducer's buckets when final (rebuilt, or never to be rebuilt), else None."""
    if not will_rebuild(ddp):
        return initial_buckets(ddp)
    if has_rebuilt_buckets(ddp):
        buckets, source = reducer_buckets(ddp)
        return buckets if source == "rebuilt" else None
    return None


def delayed_allreduce_trigger(ddp: DDP) -> torch.nn.Parameter | None:
    """The parameter holding :func:`delayed_allreduce_hook` (DDP keeps no reference to it)."""
    hook = delayed_allreduce_hook(ddp)
    if hook is None:
        return None
    for p in ddp.module.parameters():
        if any(h == hook for h in (getattr(p, "_backward_hooks", None) or {}).values()):
            return p
    return None


def delayed_allreduce_hook(ddp: DDP) -> Any | None:
    """DDP's own tensor hook that launches its delayed allreduce (``delay_all_reduce_named_params``)."""
    if not getattr(ddp, "_delay_all_reduce_params", None):
        return None
    return ddp._delayed_all_reduce_hook


# --- keeping the reducer idle (fused strategy) --------------------------------------------


def grad_sync_requested(ddp: DDP) -> bool:
    """False inside ``ddp.no_sync()``."""
    return bool(ddp.require_backward_grad_sync)


def run_forward_with_idle_reducer(ddp: DDP, args: tuple, kwargs: dict, call: Any, buffers: BufferBroadcast) -> Any:
    """DDP's forward with the reducer kept out of the backward: ``require_backward_grad_sync=False``
    (as ``no_sync()``) makes its autograd hooks do nothing; the rest stays DDP's. Static-graph
    DDP's delayed allreduce is marked done: the compiled backward already reduced."""
    user_sync = ddp.require_backward_grad_sync
    if static_graph(ddp):
        ddp._static_graph_delay_allreduce_enqueued = True
    ddp.require_backward_grad_sync = False
    try:
        args, kwargs = pre_forward(ddp, args, kwargs, buffers)
        out = ddp._post_forward(call(*args, **kwargs))
    finally:
        ddp.require_backward_grad_sync = user_sync
    ddp.require_forward_param_sync = bool(torch.is_grad_enabled() and user_sync)
    return out


# --- join() for uneven inputs --------------------------------------------------------------


def join_enabled(ddp: DDP) -> bool:
    """True inside ``with ddp.join():`` (``Join`` sets the DDP module's ``_join_config``)."""
    config = getattr(ddp, "_join_config", None)
    return bool(config is not None and config.enable)


@dataclasses.dataclass(frozen=True)
class JoinNotice:
    """This step's notification to the join context: how many ranks have not joined (``None``
    where another joinable leads the context and the count is unknown)."""

    ddp: DDP
    not_joined: int | None
    work: Any = None

    def hand_to_reducer(self) -> None:
        """What ``_pre_forward`` does with the notification when the reducer reduces the step
        (it divides by the ranks not joined); a released reducer is rebuilt only here
        (NOTE [released reducer])."""
        if self.work is not None:
            self.ddp.reducer._set_forward_pass_work_handle(self.work, self.ddp._divide_by_initial_world_size)


@contextlib.contextmanager
def join_notified(ddp: DDP) -> Iterator[JoinNotice]:
    """Inside an enabled ``ddp.join()``: send the join notification ``_pre_forward`` would send
    first, and yield it; ``_pre_forward`` inside the block does not send it again, so the
    collectives stay DDP's, in DDP's order."""
    from torch.distributed.algorithms.join import Join

    config = ddp._join_config
    work = Join.notify_join_context(ddp)
    if work is None:
        yield JoinNotice(ddp, None)
        return
    not_joined = int(work.get_future().wait()[0].item())
    ddp._join_config = config._replace(is_first_joinable=False)
    try:
        yield JoinNotice(ddp, not_joined, work)
    finally:
        ddp._join_config = config
