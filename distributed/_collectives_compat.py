"""Private torch APIs of the fused strategy: functional collectives, Inductor's comm reordering.

Checked on torch 2.11.0 (device machines) and 2.13.0 (CI).
"""

from __future__ import annotations

import heapq
from typing import Any

import torch
import torch.distributed as dist


def group_name(pg: Any) -> str:
    """The name functional collectives use to find a process group."""
    from torch.distributed import _functional_collectives as fcol

    return str(fcol._resolve_group_name(pg))


def all_reduce_sum(flat: torch.Tensor, group: str) -> torch.Tensor:
    """Functional (traceable) all-reduce sum; Inductor lowers it to an async collective whose
    ``wait_tensor`` its comm-reordering passes may sink."""
    out = torch.ops._c10d_functional.all_reduce(flat, "sum", group)
    return torch.ops._c10d_functional.wait_tensor(out)


def world_size(pg: Any) -> int:
    return dist.get_world_size(pg)


# Inductor passes that issue collectives early, by preference; the first name this torch
# version has is used. Waits are then sunk by ``sink_waits_to_consumers`` (NOTE [late waits]).
_RAISE_PASSES = ("reorder_communication_preserving_peak_memory", "raise_comms")


# NOTE [late waits]: Inductor orders the collectives of a graph with "fake" weak dependencies
# (``WeakDep(is_fake=True)``, ``comms.decide_global_ordering_of_comms``): collective k+1 depends
# on what collective k wrote, which its wait reads, so the built-in passes leave every wait right
# before the next collective (``sink_waits_iterative`` will not move a wait past a collective;
# ``sink_waits`` honours the fake dependency and drags every later collective to the end). The
# compute stream then waits for bucket k's allreduce before bucket k+1's is even issued: one
# bucket in flight, and any lag between ranks stalls the backward (seen on 2 H200s, gpt,
# non-graphed: 4.5-9.3 ms gaps). Waiting later is safe: collectives keep their order (the same
# on every rank), NCCL runs them one after another on its stream, and nothing reads a reduced
# bucket before its own wait. The fake dependencies exist only to fix that order (their own doc
# says so), so ``sink_waits_to_consumers`` replaces them by a plain chain from each collective
# to the next, and then delays every wait, and whatever reads its result (a comm hook's
# decompress), until nothing else is ready, unless a collective needs it. Cost: a compressed
# bucket stays allocated until the end of the backward (half or less of the gradient bytes,
# when activations are mostly freed).
def sink_waits_to_consumers(snodes: list[Any]) -> list[Any]:
    """Scheduler pass: a topological order of ``snodes`` that keeps the original order, except
    that waits and the nodes reading their results come as late as their users allow."""
    from torch._inductor.utils import contains_collective, contains_wait

    index = {n: i for i, n in enumerate(snodes)}
    preds = _real_predecessors(snodes)
    comms = [n for n in snodes if contains_collective(n)]
    for earlier, later in zip(comms, comms[1:]):
        preds[later].add(earlier)
    late: set[Any] = set()
    for n in snodes:  # topological: predecessors first
        if contains_wait(n) or preds[n] & late:
            late.add(n)
    late -= _ancestors(comms, preds)  # never delay a collective
    return _priority_topo_sort(snodes, preds, key=lambda n: (n in late, index[n]))


def _real_predecessors(snodes: list[Any]) -> dict[Any, set[Any]]:
    """Each node's producers among ``snodes``, from its dependencies minus Inductor's fake
    (order-only) ones."""
    producer: dict[str, Any] = {}
    for n in snodes:
        for name in (*n.get_buffer_names(), *n.get_operation_names()):
            producer[name] = n
    preds: dict[Any, set[Any]] = {}
    for n in snodes:
        deps = (d for d in n.unmet_dependencies if not getattr(d, "is_fake", False))
        preds[n] = {producer[d.name] for d in deps if d.name in producer} - {n}
    return preds


def _ancestors(nodes: list[Any], preds: dict[Any, set[Any]]) -> set[Any]:
    seen: set[Any] = set()
    stack = list(nodes)
    while stack:
        for p in preds[stack.pop()]:
            if p not in seen:
                seen.add(p)
                stack.append(p)
    return seen


def _priority_topo_sort(snodes: list[Any], preds: dict[Any, set[Any]], key: Any) -> list[Any]:
    """Kahn's algorithm, taking the ready node with the smallest ``key`` first."""
    position = {n: i for i, n in enumerate(snodes)}
    users: dict[Any, list[Any]] = {n: [] for n in snodes}
    missing = {n: len(preds[n]) for n in snodes}
    for n in snodes:
        for p in preds[n]:
            users[p].append(n)
    ready = [(key(n), i, n) for i, n in enumerate(snodes) if missing[n] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, _, n = heapq.heappop(ready)
        order.append(n)
        for u in users[n]:
            missing[u] -= 1
            if missing[u] == 0:
                heapq.heappush(ready, (key(u), position[u], u))
    if len(order) != len(snodes):
        raise AssertionError(f"expected a topological order of {len(snodes)} nodes, got {len(order)} (a cycle)")
    return order


def comm_overlap_options() -> dict[str, Any]:
    """Inductor options (applied per compile, never globally) that reorder comm and compute."""
    try:
        from torch._inductor import comms
    except ImportError:  # pragma: no cover - very old torch
        return {}
    passes: list[Any] = [name for name in _RAISE_PASSES if hasattr(comms, name)][:1]
    passes.append(sink_waits_to_consumers)
    return {"reorder_for_compute_comm_overlap": True, "reorder_for_compute_comm_overlap_passes": passes}
