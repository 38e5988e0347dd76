"""The CUDA caching allocator around CUDA-graph captures (cudagraphs/runner.py).

Checked on torch 2.11.0 (device machines) and 2.13.0, 2.15.0 (CPU builds: the calls exist and are
not reached without CUDA). Inductor's cudagraph trees make the same calls around their captures.
"""

from __future__ import annotations

import torch


def clear_cublas_workspaces() -> None:
    """cuBLAS's per-stream workspaces, kept after a stream's first matmul: cleared before a capture,
    it allocates its own in its pool; cleared after, nothing else shares it or outlives the graph."""
    torch._C._cuda_clearCublasWorkspaces()
