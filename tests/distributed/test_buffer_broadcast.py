"""DDP's buffer broadcast before the forward, done by bucketwise with the buffer list kept between
steps (NOTE [buffer broadcast] in ``_compat/ddp.py``), against eager DDP on 2 gloo ranks: every
rank sets its buffers to its own values before each step, and after the forward every buffer
holds rank 0's value, as eager DDP's; also after a buffer is reassigned, a buffer is registered,
a buffer tensor is swapped in place of another the way ``.to()`` does it, and a module is added.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from support.dist import run_distributed
from torch.nn.parallel import DistributedDataParallel as DDP


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.sub = nn.Module()
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in model.named_buffers()}


def _change(model: nn.Module, step: int, rank: int) -> None:
    """What a training script may do to its buffers between steps, each rank its own values."""
    if step == 2:
        model.scale = torch.full((4,), 5.0 + rank)  # reassigned (Module.__setattr__)
    if step == 3:
        model.sub.register_buffer("extra", torch.full((2,), 1.0 + rank))  # a new buffer
    if step == 4:
        model.sub._buffers["extra"] = torch.full((3,), 7.0 + rank)  # swapped, as Module._apply does
    if step == 5:
        model.more = nn.Linear(1, 1)  # a new module with a buffer of its own
        model.more.register_buffer("count", torch.tensor(float(rank)))
    with torch.no_grad():
        model.scale.fill_(2.0 + step + rank)  # every step, changed in place


def _worker(rank: int, world: int, strategy: str) -> list[dict[str, list[float]]]:
    import bucketwise

    torch.manual_seed(0)
    base = Scaled()
    eager = DDP(copy.deepcopy(base))
    compiled_ddp = DDP(copy.deepcopy(base))
    compiled = bucketwise.compile(compiled_ddp, backend="aot_eager", strategy=strategy)
    seen = []
    for step in range(7):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(step))
        for model, module in ((eager, eager.module), (compiled, compiled_ddp.module)):
            _change(module, step, rank)
            model(x).sum().backward()
        a, b = _buffers(eager.module), _buffers(compiled_ddp.module)
        assert a.keys() == b.keys(), (step, a.keys(), b.keys())
        for name in a:
            torch.testing.assert_close(b[name], a[name], msg=lambda m: f"step {step} {name}: {m}")
            theirs = [torch.zeros_like(b[name]) for _ in range(world)]
            dist.all_gather(theirs, b[name])
            assert all(torch.equal(t, theirs[0]) for t in theirs), (step, name, theirs)
        seen.append({n: t.tolist() for n, t in b.items()})
    for (name, p), q in zip(eager.module.named_parameters(), compiled_ddp.module.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=lambda m: f"{name}.grad: {m}")
    return seen


@pytest.mark.parametrize("strategy", ["fused", "split"])
def test_buffers_broadcast_as_eager_ddp(strategy, tmp_path):
    seen = run_distributed(_worker, tmp_path, args=(strategy,))
    # Rank 0's values, on both ranks, including the buffers that came and changed on the way.
    assert seen[0] == seen[1]
    assert seen[0][-1]["scale"] == [8.0] * 4 and seen[0][-1]["sub.extra"] == [7.0] * 3
    assert seen[0][-1]["more.count"] == 0.0


class BuildsModules(Scaled):
    """Builds a module in its forward, as HF Llama's ``self.layers[:n]`` does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (lin,) = nn.ModuleList([self.lin])[:1]
        return lin(x) * self.scale


def _steps_without_recompiles(rank: int, world: int) -> int:
    import bucketwise

    torch.manual_seed(0)
    compiled = bucketwise.compile(DDP(BuildsModules()), backend="aot_eager")
    for _ in range(4):
        compiled(torch.randn(2, 4)).sum().backward()
    return bucketwise.report(compiled).totals["recompiles"]


def test_a_module_built_in_the_forward_does_not_recompile(tmp_path):
    # Nothing the buffer broadcast watches runs inside the compiled frame.
    assert run_distributed(_steps_without_recompiles, tmp_path) == [0, 0]
