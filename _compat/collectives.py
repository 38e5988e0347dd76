"""Private torch APIs of the fused strategy: functional collectives, Inductor's comm reordering.

Checked on torch 2.11.0 (device machines) and 2.13.0 (CI).
"""

from __future__ import annotations

import functools
import heapq
from typing import Any

import torch
import torch.distributed as dist


def group_name(pg: Any) -> str:
    """The name functional collectives use to find a process group."""
    from torch.distributed import _functional_collectives as fcol

    return str(fcol._resolve_group_name(pg))


def all_reduce(flat: torch.Tensor, group: str, op: str = "sum") -> torch.Tensor:
    """Functional (traceable) all-reduce (``op``: ``"sum"``, or ``"avg"`` where the group's
    backend has it, see ``averages_natively``); Inductor lowers it to an async collective whose
    ``wait_tensor`` its comm-reordering passes may sink."""
    out = torch.ops._c10d_functional.all_reduce(flat, op, group)
    return torch.ops._c10d_functional.wait_tensor(out)


def averages_natively(pg: Any) -> bool:
    """Whether ``pg``'s all-reduce of floating-point data has an average that multiplies each
    rank's contribution by ``float(1/world)`` before summing: NCCL's ``ncclAvg`` (a pre-multiplied
    sum, NCCL >= 2.10); not gloo, which has no average."""
    return dist.get_backend(pg) == "nccl"


def all_gather(t: torch.Tensor, group: str, world: int) -> torch.Tensor:
    """Functional (traceable) all-gather along dim 0: ``world`` times ``t``'s rows, rank order."""
    out = torch.ops._c10d_functional.all_gather_into_tensor(t.contiguous(), world, group)
    return torch.ops._c10d_functional.wait_tensor(out)


def world_size(pg: Any) -> int:
    return dist.get_world_size(pg)


# Checked on torch 2.13.0 (CI) only so far: the functional collectives' fake kernels and
# ``AsyncCollectiveTensor`` (used by traceable comm hooks).


def collective_input_bytes(fn: Any) -> int | None:
    """Bytes this rank hands to functional collectives when ``fn(fake_mode)`` runs on fake
    tensors it makes in ``fake_mode`` (nothing is sent); ``None`` if ``fn`` fails so."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    wait_op = torch.ops._c10d_functional.wait_tensor.default

    class Count(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if getattr(func, "namespace", None) == "_c10d_functional" and func is not wait_op and args:
                first = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
                self.total += sum(t.numel() * t.element_size() for t in first if isinstance(t, torch.Tensor))
            return func(*args, **(kwargs or {}))

    fake_mode = FakeTensorMode()
    try:
        with fake_mode, Count() as count:
            fn(fake_mode)
    except Exception:  # noqa: BLE001 - a hook that cannot run on fake tensors: bytes unknown
        return None
    return count.total


def wait(t: Any) -> Any:
    """A functional collective's result as a plain tensor: run eagerly, ``funcol`` returns an
    ``AsyncCollectiveTensor`` to wait for; traced, already a plain (waited) tensor."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t


# NOTE [late waits]: Inductor's fake weak dependencies between collectives make its built-in
# passes put each wait right before the next collective, so one bucket is in flight at a time and
# any lag between ranks stalls the backward. Waiting later is safe: collectives keep their order
# on every rank and nothing reads a bucket before its wait. So this pass keeps only the
# collectives' order, schedules their inputs early and delays every wait (and its readers) until
# nothing else is ready. It runs alone: Inductor's raise pass would change nothing after it.
def sink_waits_to_consumers(snodes: list[Any]) -> list[Any]:
    """Scheduler pass: a topological order of ``snodes`` where what each collective needs comes
    first, collective by collective, then the rest in the original order, and waits and the
    nodes reading their results as late as their users allow."""
    from torch._inductor.utils import contains_collective, contains_wait

    index = {n: i for i, n in enumerate(snodes)}
    producer = {name: n for n in snodes for name in (*n.get_buffer_names(), *n.get_operation_names())}
    preds = _real_predecessors(snodes, producer)
    comms = [n for n in snodes if contains_collective(n)]
    for later, earlier in _comm_order(snodes, producer, preds, contains_collective, contains_wait):
        preds[later].add(earlier)
    late = _descendants([n for n in snodes if contains_wait(n)], preds)
    # Each node is due by the first collective that needs it (raise collectives, in their order).
    due: dict[Any, int] = {}
    for rank, comm in enumerate(_priority_topo_sort(comms, _restrict(preds, comms), key=index.__getitem__)):
        for n in _ancestors([comm], preds, stop=due) | {comm}:
            due.setdefault(n, rank)
    late -= due.keys()  # never delay a collective
    never = len(comms)
    return _priority_topo_sort(snodes, preds, key=lambda n: (n in late, due.get(n, never), index[n]))


def _real_predecessors(snodes: list[Any], producer: dict[str, Any]) -> dict[Any, set[Any]]:
    """Each node's producers among ``snodes`` (``producer``: buffer or operation name -> node),
    from its dependencies minus Inductor's fake (order-only) ones."""
    preds: dict[Any, set[Any]] = {}
    for n in snodes:
        deps = (d for d in n.unmet_dependencies if not getattr(d, "is_fake", False))
        preds[n] = {producer[d.name] for d in deps if d.name in producer} - {n}
    return preds


def _comm_order(
    snodes: list[Any], producer: dict[str, Any], preds: dict[Any, set[Any]], is_comm: Any, is_wait: Any
) -> list[tuple[Any, Any]]:
    """``(later, earlier)`` pairs of collectives in Inductor's global order: from its fake
    dependencies (collective k+1 on collective k, or on the wait of k after Inductor renamed the
    waited buffer), else the order of ``snodes``. The list order alone is not it: Inductor's
    own comm passes may already have swapped collectives (seen: a late bucket's allreduce
    before the first bucket's, which then waited for the whole backward)."""
    pairs = []
    for n in snodes:
        if not is_comm(n):
            continue
        for d in n.unmet_dependencies:
            p = producer.get(d.name) if getattr(d, "is_fake", False) else None
            if p is None or p is n:
                continue
            if is_comm(p):
                pairs.append((n, p))
            elif is_wait(p):
                pairs += [(n, q) for q in preds[p] if is_comm(q)]
    if pairs:
        return pairs
    comms = [n for n in snodes if is_comm(n)]
    return list(zip(comms[1:], comms))


def _ancestors(nodes: list[Any], preds: dict[Any, set[Any]], stop: Any = ()) -> set[Any]:
    """Every predecessor of ``nodes``, transitively, not walking through those in ``stop``."""
    seen: set[Any] = set()
    stack = list(nodes)
    while stack:
        for p in preds[stack.pop()]:
            if p not in seen and p not in stop:
                seen.add(p)
                stack.append(p)
    return seen


def _descendants(nodes: list[Any], preds: dict[Any, set[Any]]) -> set[Any]:
    """``nodes`` and everything that depends on them, transitively."""
    users: dict[Any, list[Any]] = {}
    for n, ps in preds.items():
        for p in ps:
            users.setdefault(p, []).append(n)
    seen, stack = set(nodes), list(nodes)
    while stack:
        for u in users.get(stack.pop(), ()):
            if u not in seen:
                seen.add(u)
                stack.append(u)
    return seen


def _restrict(preds: dict[Any, set[Any]], nodes: list[Any]) -> dict[Any, set[Any]]:
    keep = set(nodes)
    return {n: preds[n] & keep for n in nodes}


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


def comm_overlap_options(key: str) -> dict[str, Any]:
    """Inductor options (applied per compile, never globally) that reorder comm and compute;
    ``key``: the cache key of this module's scheduler pass (``cache_keys.comm_pass_key``)."""
    return {"reorder_for_compute_comm_overlap": True, "reorder_for_compute_comm_overlap_passes": [SinkWaitsPass(key)]}


class SinkWaitsPass:
    """:func:`sink_waits_to_consumers` as Inductor's FX graph cache can key it: the cache hashes
    the pickled config, and a plain function pickles as its name only (a changed pass would load
    graphs scheduled by the old one). This object pickles with ``key``, a hash of this file
    (NOTE [compile cache keys] in ``distributed/fused/cache_keys.py``)."""

    def __init__(self, key: str) -> None:
        self.key = key

    def uuid(self) -> str:
        return self.key

    def __call__(self, snodes: list[Any]) -> list[Any]:
        return sink_waits_to_consumers(snodes)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SinkWaitsPass) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return f"SinkWaitsPass({self.key!r})"


# -- grouping all-reduces after the backward is traced ---------------------------------------
# Checked on torch 2.13.0 (CPU, gloo); the same names exist on 2.11.0 (``CustomGraphPass``,
# ``stable_topological_sort``, ``_c10d_functional.all_reduce_coalesced`` and its Inductor lowering).


def is_all_reduce(node: Any) -> bool:
    """A functional all-reduce as a post-grad pass sees it (before Inductor reinplaces it)."""
    return node.op == "call_function" and node.target is torch.ops._c10d_functional.all_reduce.default


def op_name(node: Any) -> str | None:
    """``namespace::name`` of the operator ``node`` calls, if it calls one."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return schema.name if schema is not None else None


def coalesce_all_reduces(graph: Any, groups: list[list[Any]]) -> None:
    """Each group of functional all-reduce nodes (one reduce op, one process group) becomes one
    ``all_reduce_coalesced`` right after the group's last member: one collective call for the
    group (NCCL runs its all-reduces as one grouped launch). Every member's readers (its
    ``wait_tensor``) read that call's output for it instead; the graph is then put back in a
    topological order that keeps every other node where it was."""
    import operator

    from torch._inductor.pattern_matcher import stable_topological_sort

    for group in groups:
        ops = {(n.args[1], n.args[2]) for n in group}
        if len(ops) != 1:
            raise AssertionError(f"expected one reduce op and group per coalesced all-reduce, got {sorted(ops)}")
        reduce_op, name = ops.pop()
        with graph.inserting_after(group[-1]):
            coalesced = graph.call_function(
                torch.ops._c10d_functional.all_reduce_coalesced.default, ([n.args[0] for n in group], reduce_op, name)
            )
        coalesced.meta.update(group[-1].meta)
        coalesced.meta["val"] = [n.meta["val"] for n in group]
        last = coalesced
        for i, node in enumerate(group):
            with graph.inserting_after(last):
                out = last = graph.call_function(operator.getitem, (coalesced, i))
            out.meta.update(node.meta)
            node.replace_all_uses_with(out)
            graph.erase_node(node)
    stable_topological_sort(graph)


def post_grad_pass(fn: Any, key: str) -> Any:
    """``fn(graph)`` as Inductor's ``post_grad_custom_post_pass``, cache-keyed by ``key`` (NOTE
    [compile cache keys]): Inductor keys a graph by its custom passes' ``uuid()``."""
    return _post_grad_pass_class()(fn, key)


@functools.lru_cache(maxsize=None)
def _post_grad_pass_class() -> Any:
    # Made on first use: importing Inductor's pass module costs most of a second.
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class PostGradPass(CustomGraphPass):
        def __init__(self, fn: Any, key: str) -> None:
            self.fn, self.key = fn, key

        def __call__(self, graph: Any) -> None:
            self.fn(graph)

        def uuid(self) -> str:
            return self.key

    return PostGradPass
