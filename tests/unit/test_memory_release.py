"""Dropping what ``bucketwise.compile`` returned, with the model and its optimizer, frees them at
the next ``gc.collect()``, as after plain ``torch.compile`` (NOTE [a compiled object lets go]).

Checked by reference: after the drop and one ``gc.collect()`` no parameter, gradient, module
or compiled object may still be alive, with and without (emulated) CUDA graphs. The GPU side,
bytes at rest against ``torch.compile(mode="reduce-overhead")``, is tests/gpu/test_gpu_memory.py.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn as nn
from support.cudagraph_emulator import use_emulated_graphs
from torch.nn.parallel import DistributedDataParallel as DDP

import bucketwise


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))


def _train_and_drop(make, *, ddp: bool) -> tuple[list[weakref.ref], int]:
    """Train 3 steps, drop everything; returns weak references to what must be freed, and how
    many of them the drop alone (without gc) left alive."""
    net = _net()
    model = DDP(net) if ddp else net
    compiled = make(model)
    opt = torch.optim.AdamW(net.parameters())
    for _ in range(3):
        compiled(torch.randn(8, 32)).pow(2).mean().backward()
        opt.step()
    grads = [p.grad for p in net.parameters()]
    refs = [weakref.ref(o) for o in (net, model, compiled, opt, *net.parameters(), *grads)]
    del net, model, compiled, opt, grads
    return refs, sum(r() is not None for r in refs)


def _alive_after_gc(refs: list[weakref.ref]) -> list[str]:
    gc.collect()
    return [type(r()).__name__ for r in refs if r() is not None]


@pytest.mark.parametrize("strategy", ["fused", "split", "none"])
def test_compiled_ddp_module_is_freed_at_gc(single_rank_group, strategy):
    refs, _ = _train_and_drop(lambda m: bucketwise.compile(m, backend="aot_eager", strategy=strategy), ddp=True)
    assert _alive_after_gc(refs) == []


def test_compiled_plain_module_and_torch_compile_are_freed_at_gc():
    for make in (lambda m: bucketwise.compile(m, backend="aot_eager"), lambda m: torch.compile(m, backend="aot_eager")):
        refs, _ = _train_and_drop(make, ddp=False)
        assert _alive_after_gc(refs) == []


def test_cuda_graph_recordings_are_freed_at_gc(monkeypatch):
    emulators = use_emulated_graphs(monkeypatch)
    refs, _ = _train_and_drop(lambda m: bucketwise.compile(m, backend="inductor", cudagraphs=True), ddp=False)
    assert emulators and emulators[0].captures >= 2, "the graphs were never recorded"
    assert _alive_after_gc(refs) == []


def test_a_second_compile_of_the_same_frame_after_the_first_is_gone_works(single_rank_group):
    # The frames a dropped compiled object compiled are forgotten; nothing else is: a new
    # compile of another model trains and reports its graph.
    refs, _ = _train_and_drop(lambda m: bucketwise.compile(m, backend="aot_eager"), ddp=True)
    assert _alive_after_gc(refs) == []
    compiled = bucketwise.compile(DDP(_net()), backend="aot_eager")
    compiled(torch.randn(8, 32)).sum().backward()
    assert bucketwise.report(compiled).totals["graphs"] == 1
