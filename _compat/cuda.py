"""The CUDA caching allocator around CUDA-graph captures (cudagraphs/runner.py).

Checked on torch 2.11.0 (device machines) and 2.13.0, 2.15.0 (CPU builds: the calls exist and are
not reached without CUDA). Inductor's cudagraph trees make the same calls around their captures.
"""

from __future__ import annotations

import torch


def clear_cublas_workspaces() -> None:
    """Let go of cuBLAS's per-stream workspaces (allocated at a stream's first matmul, then kept).
    Cleared before a capture, the capture allocates its own inside its pool; cleared after, the
    allocator no longer holds it (the pool keeps it while the graph lives), so no later capture or
    eager matmul shares it and nothing of the pool stays allocated once the graph is gone."""
    torch._C._cuda_clearCublasWorkspaces()
