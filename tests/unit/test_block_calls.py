"""The forward bucketwise gives a block while a compiled call runs (NOTE [a block call in straight
lines]) takes the block's own parameters and buffers, by name, and its modules' ``training``
flags, for any nesting: checked here on one process, without Dynamo. What Dynamo and the graph
backend make of the call is checked against eager DDP in tests/distributed/test_shared_blocks.py."""

from __future__ import annotations

import gc
import linecache

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from bucketwise.compiler.blocks import calls


class Inner(nn.Module):
    def __init__(self, shared: nn.Linear) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 6, bias=False)  # a parameter that is None
        self.shared = shared  # the same module under two names
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 6))
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.shared(self.proj(x)) * self.scale)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        shared = nn.Linear(6, 6)
        self.first = shared
        self.inner = nn.ModuleDict({"a": Inner(shared), "b": nn.Sequential(nn.Linear(6, 6), nn.Tanh())})

    def forward(self, x: torch.Tensor, *, pair: tuple[torch.Tensor, torch.Tensor], gain: float = 1.0) -> torch.Tensor:
        y = self.inner["b"](self.inner["a"](self.first(x)))
        return (y + pair[0] * pair[1]) * gain


def test_the_block_forward_runs_the_block_on_its_own_tensors():
    torch.manual_seed(0)
    block = Block()
    block.inner["a"].drop.eval()  # a submodule in another mode than its block: no dropout there
    entry = calls._entry(block)
    x, pair = torch.randn(3, 6), (torch.randn(3, 6), torch.randn(3, 6))
    want = block(x, pair=pair, gain=2.0)
    got = entry.forward(x, pair=pair, gain=2.0)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert entry.names == (
        "first.weight",
        "first.bias",
        "inner.a.scale",
        "inner.a.proj.weight",
        "inner.a.shared.weight",  # the same tensors as first's, taken twice as the module holds them
        "inner.a.shared.bias",
        "inner.b.0.weight",
        "inner.b.0.bias",
    ), entry.names
    # Outside a compiled call the block's own forward is untouched.
    assert "forward" not in block.__dict__
    # A traceback through the generated forward shows its line; the line goes with the block.
    filename = entry.forward.__code__.co_filename
    assert "return block_call(" in "".join(linecache.getlines(filename)), linecache.getlines(filename)
    del block, entry
    gc.collect()
    assert not linecache.getlines(filename)


def test_the_block_forward_records_every_module_s_training_flag_on_fake_tensors():
    with FakeTensorMode():
        block = Block()
        block.inner["a"].drop.eval()
        entry = calls._entry(block)
        x, pair = torch.randn(3, 6), (torch.randn(3, 6), torch.randn(3, 6))
        out = entry.forward(x, pair=pair, gain=2.0)
    assert out.shape == (3, 6)
    training, names, args, values = entry.fingerprint[-1]
    assert training == tuple(m.training for m in block.modules()), training
    assert training.count(False) == 1, training
    assert (names, values) == (("pair", "gain"), (("tensor", "tensor"), "2.0")), (names, values)


class Gain:
    """An argument ``block_call`` cannot take (not a tensor, number, string or sequence of them)."""

    def __rmul__(self, other: torch.Tensor) -> torch.Tensor:
        return other * 2.0


def test_a_block_called_with_an_object_runs_its_own_forward():
    torch.manual_seed(0)
    with FakeTensorMode():
        block = Block()
        entry = calls._entry(block)
        x, pair = torch.randn(3, 6), (torch.randn(3, 6), torch.randn(3, 6))
        assert entry.forward(x, pair=pair, gain=Gain()).shape == (3, 6)
    assert entry.fingerprint is None  # block_call never ran: no computation recorded
    block = Block().eval()  # no dropout: the two runs compare
    entry = calls._entry(block)
    x, pair = torch.randn(3, 6), (torch.randn(3, 6), torch.randn(3, 6))
    torch.testing.assert_close(entry.forward(x, pair=pair, gain=Gain()), block(x, pair=pair, gain=2.0))
