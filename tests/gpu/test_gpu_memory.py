"""GPU memory of a compiled model: at rest, at its peak, and once it is dropped (one GPU, one rank).

Each config runs in a process of its own (``benchmarks/ddp/memory.py --one``): an MLP of 8
layers trained 5 steps with fused AdamW, then dropped. bucketwise's CUDA graphs must hold no more
device memory than Inductor's (``mode="reduce-overhead"``): at rest (within 1.05x) and at the
peak (within 1.03x), counted as the memory the allocator reserves (the pools of both included;
torch's cudagraph trees hand their outputs out as pool memory that ``memory_allocated`` does not
count, so reserved memory is what compares). A dropped model, with or without CUDA graphs, must
leave no more allocated than plain ``torch.compile`` leaves after ``gc.collect()``, and after
``torch._dynamo.reset()`` too.

Every config compiles cold, as on a user's first run (Inductor's and Triton's caches empty, one
directory per process): a warm cache skips Triton's autotuning, whose benchmarks allocate
(an L2-flush buffer per benchmark) inside the first, uncaptured call of each graph, and cuBLAS
allocates its workspaces there too: the peak is the first steps'.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MODEL = ["--model", "mlp", "--layers", "8", "--d-model", "2048", "--batch", "256", "--steps", "5"]
SLACK_MIB = 1.0


def _measure(config: str, caches: Path) -> dict[str, float]:
    cmd = [sys.executable, "-m", "bucketwise.benchmarks", "memory", *MODEL, "--one", config]
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
        "TRITON_CACHE_DIR": str(caches / "triton"),
    }
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False, env=env)
    for line in done.stdout.splitlines():
        if line.startswith("MEMORY_BENCH "):
            return json.loads(line.removeprefix("MEMORY_BENCH "))
    raise AssertionError(f"{config} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")


@pytest.fixture(scope="module")
def figures(tmp_path_factory) -> dict[str, dict[str, float]]:
    # The configs run at once: each process's allocator counts only its own memory.
    configs = ("local", "bw-fused", "local-ro", "bw-fused-cg")
    caches = [tmp_path_factory.mktemp(config) for config in configs]
    with ThreadPoolExecutor(len(configs)) as pool:
        return dict(zip(configs, pool.map(_measure, configs, caches)))


def test_cuda_graphs_hold_no_more_than_inductors_at_rest(figures):
    ours, torchs = figures["bw-fused-cg"], figures["local-ro"]
    assert ours["rest_reserved"] <= 1.05 * torchs["rest_reserved"], (ours, torchs)


def test_cuda_graphs_peak_no_higher_than_inductors_on_a_cold_compile(figures):
    ours, torchs = figures["bw-fused-cg"], figures["local-ro"]
    assert ours["peak_reserved"] <= 1.03 * torchs["peak_reserved"], (ours, torchs)


def test_a_dropped_model_leaves_what_torch_compile_leaves(figures):
    floor = figures["local"]
    for config in ("bw-fused", "bw-fused-cg"):
        mine = figures[config]
        assert mine["after_gc"] <= floor["after_gc"] + SLACK_MIB, (config, mine, floor)
        assert mine["after_reset"] <= floor["after_reset"] + SLACK_MIB, (config, mine, floor)
