"""Host work per training step, whole graph against shared blocks, counted rather than timed: the
Python function calls of one step (``cProfile``'s count, the same from run to run whatever the
machine is doing), the host time of one call of the shared block's operator, and of the check of
the blocks' plain attributes made before every compiled call (NOTE [Dynamo calls a block]).

    python -m bucketwise.benchmarks probe host_calls [--layers 4]

A tiny HF Llama on the CPU, one rank (gloo), ``fused``, Inductor. Behind NOTE [one Python call per
op] (``_compat/ops.py``); quoted in
``benchmarks/results/2026-11-27_1xH200_shared-blocks-op-calls-host-time``.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from bucketwise.benchmarks.probes._tiny import one_cpu_rank, tiny_llama

STEPS = 10
CALLS = 5000


def python_calls_per_step(layers: int, share_blocks: bool) -> float:
    import bucketwise

    torch.manual_seed(0)
    model = bucketwise.compile(DDP(tiny_llama(layers, hidden=32)), strategy="fused", share_blocks=share_blocks)
    ids = torch.randint(0, 64, (1, 8))
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(STEPS):
        model(input_ids=ids, labels=ids).loss.backward()
    prof.disable()
    return pstats.Stats(prof).total_calls / STEPS


def operator_call_us() -> dict[str, float]:
    """Host time of one call of an operator that takes 30 tensors (parameters) and returns the
    first, under ``no_grad``: registered as the shared block's are (``_compat.ops.define``) and as
    a ``torch.library.custom_op``; the two alternate, twice, and the faster round of each counts."""
    from bucketwise._compat import ops

    def kernel(key: int, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [xs[0].clone()]

    def fake(key: int, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [torch.empty_like(xs[0])]

    defined = ops.define("bucketwise_probe::defined", "(int key, Tensor[] xs) -> Tensor[]", kernel=kernel, fake=fake)
    custom = torch.library.custom_op("bucketwise_probe::custom", kernel, mutates_args=())
    custom.register_fake(fake)
    xs = [torch.nn.Parameter(torch.ones(4)) for _ in range(30)]
    best = {"ops.define": float("inf"), "custom_op": float("inf")}
    for _ in range(2):
        for name, op in (("ops.define", defined), ("custom_op", torch.ops.bucketwise_probe.custom.default)):
            with torch.no_grad():
                for _ in range(200):
                    op(0, xs)
                start = time.perf_counter()
                for _ in range(CALLS):
                    op(0, xs)
            best[name] = min(best[name], (time.perf_counter() - start) / CALLS * 1e6)
    return best


def compiled_call_us() -> dict[str, float]:
    """Host time of one call of a small graph compiled by Inductor as a shared block's are
    (``_compat.aot.inductor_compile``): through Inductor's ``CompiledFxGraph.__call__``, as
    bucketwise calls it (NOTE [a compiled block called directly]), and the generated ``call``
    alone; they alternate, twice, and the faster round of each counts."""
    from bucketwise._compat import aot

    def f(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.relu(x @ y) + 1,)

    x, y = torch.randn(4, 4), torch.randn(4, 4)
    compiled = aot.inductor_compile_function(f, [x, y])
    compiled([x, y])
    calls = {
        "Inductor's wrapper": compiled.compiled,
        "bucketwise": compiled,
        "generated call": compiled.generated,
    }
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(2):
        for name, fn in calls.items():
            for _ in range(200):
                fn([x, y])
            start = time.perf_counter()
            for _ in range(CALLS):
                fn([x, y])
            best[name] = min(best[name], (time.perf_counter() - start) / CALLS * 1e6)
    return best


def attribute_check_us(layers: int = 32) -> tuple[int, float]:
    """The plain attributes of a ``layers``-layer tiny HF Llama's blocks, and the host time of one
    comparison of them with their first values (``BlockCalls.changed``), the best of five rounds."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from bucketwise.compiler.block_calls import find_block_calls

    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4, vocab_size=64
    )
    calls = find_block_calls(LlamaForCausalLM(config))
    calls.changed()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(1000):
            calls.changed()
        best = min(best, (time.perf_counter() - start) / 1000 * 1e6)
    return len(calls.attributes), best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args(argv)
    one_cpu_rank(29581)
    try:
        for share in (False, True):
            calls = python_calls_per_step(args.layers, share)
            print(f"{'shared blocks' if share else 'whole graph':>13}: {calls:,.1f} Python calls per step")
        for name, us in operator_call_us().items():
            print(f"{name:>13}: {us:.1f} us per operator call (30 tensors)")
        for name, us in compiled_call_us().items():
            print(f"{name:>18}: {us:.2f} us per call of a compiled graph (mm, relu, add on 4 x 4)")
        n, us = attribute_check_us()
        print(f"   attributes: {us:.1f} us per comparison of a 32-layer HF Llama's {n} plain block attributes")
    finally:
        dist.destroy_process_group()
    return 0
