"""A CPU stand-in for ``bucketwise.cudagraphs.runner.CudaGraphs`` (the test seam).

It keeps the three properties of a real CUDA graph that bucketwise's runner must respect:
capture runs nothing (inputs are restored, so in-place updates of buffers happen once), a
replay writes its results into the very output tensors the capture returned, and the graph
holds no reference to its inputs (a replay reads whatever lives at their addresses: here the
tensors the runner passes to ``replay``, which must sit at the captured addresses).
"""

from __future__ import annotations

import torch


class EmulatedGraphs:
    device_type = "cpu"

    def __init__(self, *, fail_capture: bool = False) -> None:
        self.captures = 0
        self.replays = 0
        self.output_ptrs: set[int] = set()
        """Addresses of every recorded graph's static outputs."""
        self.fail_capture = fail_capture

    def capture(self, fn, inputs):
        if self.fail_capture:
            raise RuntimeError("emulated capture failure")
        self.captures += 1
        saved = [(t, t.clone()) for t in inputs if isinstance(t, torch.Tensor)]
        ptrs = [t.data_ptr() if isinstance(t, torch.Tensor) else None for t in inputs]
        out = fn(list(inputs))
        for t, before in saved:
            t.copy_(before)
        self.output_ptrs.update(o.data_ptr() for o in out if isinstance(o, torch.Tensor))
        return (fn, ptrs, list(out)), out

    def replay(self, graph, inputs) -> None:
        self.replays += 1
        fn, ptrs, outs = graph
        now = [t.data_ptr() if isinstance(t, torch.Tensor) else None for t in inputs]
        if now != ptrs:
            raise AssertionError(f"replay inputs are not at the captured addresses: {ptrs} vs {now}")
        with torch.no_grad():
            for o, n in zip(outs, fn(list(inputs))):
                if isinstance(o, torch.Tensor):
                    o.copy_(n)

    def reserved_bytes(self) -> int:
        return 0

    def wait_idle(self, timeout_s: float) -> bool:
        return True


def use_emulated_graphs(monkeypatch=None, **kwargs) -> list[EmulatedGraphs]:
    """Make every bucketwise compile in this process (its GraphBackend) wrap graphs with an
    emulated CUDA-graph group, as ``cudagraphs=True`` does on a GPU. Returns the emulators.
    Without ``monkeypatch`` (a spawned worker process) the change lasts for the process."""
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
