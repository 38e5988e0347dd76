"""A CPU stand-in for ``bucketwise.compiler.cudagraphs.CudaGraphs`` (the test seam).

It keeps the two properties of a real CUDA graph that bucketwise's runner must respect:
capture runs nothing (inputs are restored, so in-place updates of buffers happen once), and a
replay writes its results into the very output tensors the capture returned.
"""

from __future__ import annotations

import torch


class EmulatedGraphs:
    device_type = "cpu"

    def __init__(self, *, fail_capture: bool = False) -> None:
        self.captures = 0
        self.replays = 0
        self.fail_capture = fail_capture

    def capture(self, fn, inputs):
        if self.fail_capture:
            raise RuntimeError("emulated capture failure")
        self.captures += 1
        saved = [(t, t.clone()) for t in inputs if isinstance(t, torch.Tensor)]
        out = fn()
        for t, before in saved:
            t.copy_(before)
        return (fn, list(out)), out

    def replay(self, graph) -> None:
        self.replays += 1
        fn, outs = graph
        with torch.no_grad():
            for o, n in zip(outs, fn()):
                if isinstance(o, torch.Tensor):
                    o.copy_(n)

    def reserved_bytes(self) -> int:
        return 0


def use_emulated_graphs(monkeypatch=None, **kwargs) -> list[EmulatedGraphs]:
    """Make every bucketwise compile in this process (its GraphBackend) wrap graphs with an
    emulated CUDA-graph group, as ``cudagraphs=True`` does on a GPU. Returns the emulators.
    Without ``monkeypatch`` (a spawned worker process) the change lasts for the process."""
    from bucketwise.compiler import graph_backend
    from bucketwise.compiler.cudagraphs import CudaGraphGroup

    made: list[EmulatedGraphs] = []

    def group(self):
        if self.config.cudagraphs is False:
            return None
        made.append(EmulatedGraphs(**kwargs))
        return CudaGraphGroup(self.report.add_cudagraph, made[-1])

    if monkeypatch is not None:
        monkeypatch.setattr(graph_backend.GraphBackend, "_cudagraph_group", group)
    else:
        graph_backend.GraphBackend._cudagraph_group = group
    return made
