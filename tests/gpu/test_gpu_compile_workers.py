"""Inductor's Triton compile workers start when a module on the GPU is compiled for Inductor, not
at its first call (NOTE [compile workers from the start]). Each case is a new process, whose
child processes are counted before and after ``bucketwise.compile``. Skipped without CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
psutil = pytest.importorskip("psutil")

CHILD = textwrap.dedent(
    """
    import sys, time
    import psutil, torch
    import bucketwise

    def children():
        return len(psutil.Process().children(recursive=True))

    before = children()
    bucketwise.compile(torch.nn.Linear(8, 8).cuda(), backend=sys.argv[1])
    deadline = time.monotonic() + 5
    while children() <= before and time.monotonic() < deadline:
        time.sleep(0.1)
    print("CHILDREN", before, children())
    """
)


def _children(backend: str, **env: str) -> tuple[int, int]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, backend],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(line for line in out.stdout.splitlines() if line.startswith("CHILDREN"))
    before, after = map(int, line.split()[1:])
    return before, after


def test_compiling_for_inductor_starts_the_compile_workers():
    before, after = _children("inductor")
    assert after > before, f"expected Triton compile workers after compile(), got {after} processes for {before}"


@pytest.mark.parametrize(("backend", "env"), [("aot_eager", {}), ("inductor", {"TORCH_WARM_POOL": "0"})])
def test_no_compile_workers_without_inductor_or_with_the_pool_off(backend, env):
    before, after = _children(backend, **env)
    assert after == before, f"expected no new processes ({backend}, {env}), got {after} for {before}"
