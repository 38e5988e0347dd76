"""A CPU stand-in for ``bucketwise.cudagraphs.cuda.CudaGraphs`` (the test seam).

It keeps the properties of a real CUDA graph that bucketwise's runner must respect: capture
runs nothing (inputs are restored, so in-place updates of buffers happen once), a replay writes
its results into the very output tensors the capture returned, the graph holds no reference to
its inputs (a replay reads whatever lives at their addresses: here the tensors the runner passes
to ``replay``, which must sit at the captured addresses), and graphs sharing a memory pool
overwrite each other's outputs: a replay fills the floating-point outputs of every other graph
of its pool with NaN (on a GPU, whatever the replay wrote there), so a test that reads a tensor
some graph of the pool overwrote sees it.
"""

from __future__ import annotations

import contextlib
import weakref

import torch


class EmulatedGraphs:
    device_type = "cpu"

    def __init__(self, *, fail_capture: bool = False) -> None:
        self.captures = 0
        self.replays = 0
        self.output_ptrs: set[int] = set()
        """Addresses of every recorded graph's static outputs."""
        self.fail_capture = fail_capture
        self.shared = 0
        """Captures into another graph's pool."""
        self.pools = 0
        """Pools made (one per warm-up or recording that joins none)."""
        self.allocated_in: list[weakref.ref[_Pool]] = []
        """The pool of every block of eager allocations (warm-ups, copy buffers), in order (held
        weakly: a dropped model frees its pools)."""
        self.warm_pools_at_capture = 0
        """The most pools without a graph (warm-up pools) alive at any capture, besides its own."""
        self.poisoned: list[str] = []
        """The message of every storage made to raise on access."""
        self.reserved: list[int] = []
        """Bytes each new pool was asked to start with, in order."""
        self.calls: list[str] = []
        """``"pool"``, ``"release"`` and ``"capture"``, in the order the runner made them."""

    def new_pool(self, reserve=0):
        self.pools += 1
        self.reserved.append(reserve)
        self.calls.append("pool")
        return _Pool()

    def release_cached(self):
        self.calls.append("release")

    def allocating_in(self, pool):
        self.allocated_in.append(weakref.ref(pool))
        return contextlib.nullcontext()

    def capture(self, fn, inputs, *, pool):
        if self.fail_capture:
            raise RuntimeError("emulated capture failure")
        self.captures += 1
        self.calls.append("capture")
        alive = {id(p): p for p in (r() for r in self.allocated_in) if p is not None and p is not pool and not p.graphs}
        self.warm_pools_at_capture = max(self.warm_pools_at_capture, len(alive))
        saved = [(t, t.clone()) for t in inputs if isinstance(t, torch.Tensor)]
        ptrs = [t.data_ptr() if isinstance(t, torch.Tensor) else None for t in inputs]
        input_storages = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
        out = fn(inputs)
        for t, before in saved:
            t.copy_(before)
        self.output_ptrs.update(o.data_ptr() for o in out if isinstance(o, torch.Tensor))
        if pool.graphs:
            self.shared += 1
        # What the capture allocated lives in the pool; inputs handed back do not.
        in_pool = [
            o for o in out if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in input_storages
        ]
        graph = _Graph(fn, ptrs, list(out), pool.graphs, in_pool)
        pool.graphs.append(graph)
        return graph, out

    def replay(self, graph, inputs) -> None:
        self.replays += 1
        now = [t.data_ptr() if isinstance(t, torch.Tensor) else None for t in inputs]
        if now != graph.ptrs:
            raise AssertionError(f"replay inputs are not at the captured addresses: {graph.ptrs} vs {now}")
        with torch.no_grad():
            new = graph.fn(list(inputs))
            for other in graph.pool:
                if other is not graph:
                    for o in other.in_pool:
                        if o.is_floating_point():
                            o.fill_(float("nan"))
            for o, n in zip(graph.outs, new):
                if isinstance(o, torch.Tensor):
                    o.copy_(n)

    def poison(self, t, message):
        """Where a GPU makes the storage raise ``message`` on access: note it (on the CPU the
        memory is freed with the graph, so nothing may read it after)."""
        self.poisoned.append(message)

    def reserved_bytes(self) -> int:
        return 0

    def wait_idle(self, timeout_s: float) -> bool:
        return True


class _Pool:
    def __init__(self) -> None:
        self.graphs: list[_Graph] = []


class _Graph:
    def __init__(self, fn, ptrs, outs, pool, in_pool) -> None:
        self.fn, self.ptrs, self.outs, self.pool, self.in_pool = fn, ptrs, outs, pool, in_pool


def use_emulated_graphs(monkeypatch=None, **kwargs) -> list[EmulatedGraphs]:
    """Make every bucketwise compile in this process (its GraphBackend) wrap graphs with an
    emulated CUDA-graph group, as ``cudagraphs=True`` does on a GPU. Returns the emulators.
    Without ``monkeypatch`` (a rank's own process) the change lasts for the process."""
    from bucketwise.compiler import graph_backend
    from bucketwise.cudagraphs.runner import CudaGraphGroup

    made: list[EmulatedGraphs] = []

    def group(self, decision):
        if self.config.cudagraphs is False:
            return None
        made.append(EmulatedGraphs(**kwargs))
        return CudaGraphGroup(self.report.add_cudagraph, made[-1])

    if monkeypatch is not None:
        monkeypatch.setattr(graph_backend.GraphBackend, "_cudagraph_group", group)
    else:
        graph_backend.GraphBackend._cudagraph_group = group
    return made
