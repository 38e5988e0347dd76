"""CUDA graph pools, capture and replay, apart from the runner so that CPU tests can emulate them."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator, Sequence

import torch

from .._compat import cuda as cuc
from .._compat import storage as st


class CudaGraphs:
    """The CUDA side of capture and replay (a test on CPU passes an emulation instead)."""

    device_type = "cuda"

    def __init__(self) -> None:
        self._stream = None

    def new_pool(self, reserve: int = 0) -> Any:
        """A memory pool for one recording (and the backward that joins it), or for warm-ups;
        ``reserve`` bytes make its first segment, one free block that later requests split
        (NOTE [a forward and its backward share a pool])."""
        pool = torch.cuda.MemPool()
        if reserve:
            with self.allocating_in(pool):
                torch.empty(reserve, dtype=torch.uint8, device=torch.cuda.current_device())
        return pool

    @contextlib.contextmanager
    def allocating_in(self, pool: Any) -> Iterator[None]:
        """Within the block, allocations come from ``pool`` on the capture stream (the caching
        allocator reuses a block only on its own stream, and captures allocate there)."""
        stream = self._capture_stream()
        current = torch.cuda.current_stream()
        stream.wait_stream(current)
        try:
            with torch.cuda.stream(stream), torch.cuda.use_mem_pool(pool):
                yield
        finally:
            current.wait_stream(stream)

    def release_cached(self) -> None:
        """Give what the caching allocator keeps free (and dropped pools' free memory) back, cuBLAS's
        workspaces first: a warm-up's sit in the warm-up pool and would keep its segments."""
        cuc.clear_cublas_workspaces()
        torch.cuda.empty_cache()

    def _capture_stream(self) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    def capture(self, fn: Callable[[list[Any]], Any], inputs: list[Any], *, pool: Any) -> tuple[Any, Any]:
        """Record ``fn(inputs)`` (which consumes ``inputs``) into a graph with memory from ``pool``.
        Nothing runs: the first replay computes. The graph keeps only the inputs' addresses."""
        stream = self._capture_stream()
        graph = torch.cuda.CUDAGraph()
        # The capture gets a cuBLAS workspace of its own, in its pool (the runner released what
        # the allocator kept free before the pool grew: ``release_cached``).
        cuc.clear_cublas_workspaces()
        try:
            # thread_local: NCCL's watchdog and other threads keep querying events meanwhile.
            with torch.cuda.graph(graph, pool=pool.id, stream=stream, capture_error_mode="thread_local"):
                out = fn(inputs)
        finally:
            cuc.clear_cublas_workspaces()
        return graph, out

    def replay(self, graph: Any, inputs: Sequence[Any]) -> None:
        """Replay ``graph``; ``inputs`` are the tensors at the recorded addresses right now
        (a real graph reads the addresses; an emulation reads the tensors)."""
        graph.replay()

    def poison(self, t: torch.Tensor, message: str) -> None:
        """Every tensor on ``t``'s storage raises ``message`` on access from now on."""
        st.poison(t, message)

    def reserved_bytes(self) -> int:
        return torch.cuda.memory_reserved()

    def wait_idle(self, timeout_s: float) -> bool:
        """False if the current stream's work is still running after ``timeout_s`` (a collective
        waiting for a rank that is gone never ends: no unbounded ``synchronize()`` at exit)."""
        done = torch.cuda.Event()
        done.record()
        deadline = time.monotonic() + timeout_s
        while not done.query():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True
