"""What ``bucketwise.compile`` returns for a module is that module with a compiled forward
(NOTE [the compiled module is the module]): its names, keys and type, its hooks, copies and
pickles. One rank; the cross-rank checkpoint matrix is tests/distributed/test_checkpoints.py."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import bucketwise


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def test_a_compiled_ddp_module_is_that_ddp_module(single_rank_group):
    ddp = DDP(_net())
    compiled = bucketwise.compile(ddp, backend="aot_eager")
    assert isinstance(compiled, DDP) and compiled.module is ddp.module
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in ddp.named_parameters()]
    assert (
        list(compiled.state_dict())
        == list(ddp.state_dict())
        == ["module.0.weight", "module.0.bias", "module.2.weight", "module.2.bias"]
    )
    assert all(p is q for p, q in zip(compiled.parameters(), ddp.parameters()))
    # Flags are shared: no_sync() on either is no_sync() on both.
    with compiled.no_sync():
        assert not ddp.require_backward_grad_sync
    assert ddp.require_backward_grad_sync
    # The report is found through the DDP module and through the compiled object.
    compiled(torch.randn(2, 8)).sum().backward()
    assert bucketwise.report(ddp) is bucketwise.report(compiled)
    with pytest.raises(ValueError, match="already compiled by bucketwise"):
        bucketwise.compile(compiled)


def test_hooks_on_the_ddp_module_run_around_the_compiled_call(single_rank_group):
    ddp = DDP(_net())
    seen = []
    ddp.register_forward_pre_hook(lambda m, args: seen.append("pre"))
    ddp.register_forward_hook(lambda m, args, out: seen.append("post"))
    compiled = bucketwise.compile(ddp, backend="aot_eager")
    compiled(torch.randn(2, 8)).sum().backward()
    assert seen == ["pre", "post"]


def test_a_compiled_plain_module_keeps_the_module_class_attributes():
    class WithMethod(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.scale = 3.0

        @property
        def width(self) -> int:
            return self.lin.in_features

        def doubled(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * self(x)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * self.scale

    module = WithMethod()
    compiled = bucketwise.compile(module, backend="aot_eager")
    x = torch.randn(2, 4)
    assert compiled.width == 4 and compiled.scale == 3.0
    torch.testing.assert_close(compiled(x), module(x))
    torch.testing.assert_close(compiled.doubled(x), 2 * module(x))
    compiled.scale = 5.0  # the module's own attribute: one state
    assert module.scale == 5.0
    assert list(compiled.state_dict()) == ["lin.weight", "lin.bias"]


def test_copies_and_pickles_are_compiled_copies():
    module = _net()
    compiled = bucketwise.compile(module, backend="aot_eager", strategy="none")
    x = torch.randn(3, 8)
    expected = module(x)
    for copied in (copy.deepcopy(compiled), pickle.loads(pickle.dumps(compiled))):
        assert type(copied) is type(compiled) and copied is not compiled
        assert all(p is not q for p, q in zip(copied.parameters(), module.parameters()))
        torch.testing.assert_close(copied(x), expected)
        assert bucketwise.report(copied).totals["graphs"] == 1
        assert bucketwise.report(copied).strategy == "none"
    assert bucketwise.report(compiled).totals["graphs"] == 0


def test_an_averaged_copy_of_a_compiled_ddp_module_trains(single_rank_group):
    # torch.optim.swa_utils.AveragedModel deep-copies the model it is given.
    compiled = bucketwise.compile(DDP(_net()), backend="aot_eager")
    compiled(torch.randn(2, 8)).sum().backward()
    ema = torch.optim.swa_utils.AveragedModel(compiled)
    ema.update_parameters(compiled)
    out = ema(torch.randn(2, 8))
    assert out.shape == (2, 4)


def test_compile_workers_start_for_inductor_on_a_gpu(monkeypatch):
    # NOTE [compile workers from the start]; the workers themselves are checked on a GPU
    # (tests/gpu/test_gpu_compile_workers.py).
    from torch._subclasses.fake_tensor import FakeTensorMode

    from bucketwise._compat import aot
    from bucketwise._compat.capabilities import capabilities

    started = []
    monkeypatch.setattr(aot, "_warm_pool", lambda: started.append(True))
    with FakeTensorMode():
        on_gpu = [torch.empty(2), torch.empty(2, device="cuda")]
    assert not aot.start_compile_workers(capabilities("inductor"), on_gpu[:1]), "tensors on the CPU start no workers"
    assert not aot.start_compile_workers(capabilities("aot_eager"), on_gpu), (
        "a backend other than Inductor starts no workers"
    )
    assert not aot.start_compile_workers(capabilities(lambda gm, inputs: gm), on_gpu), "nor does a callable backend"
    assert started == []
    assert aot.start_compile_workers(capabilities("inductor"), on_gpu)
    assert started == [True]


def test_compile_asks_for_the_compile_workers_with_the_modules_tensors(monkeypatch):
    from bucketwise._compat import aot

    asked = []
    monkeypatch.setattr(aot, "start_compile_workers", lambda backend, tensors: asked.append((backend, list(tensors))))
    net = _net()
    bucketwise.compile(net, backend="aot_eager")
    assert len(asked) == 1 and asked[0][0].name == "aot_eager" and not asked[0][0].inductor
    assert [t is p for t, p in zip(asked[0][1], net.parameters())] == [True] * 4
