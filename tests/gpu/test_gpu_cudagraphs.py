"""``cudagraphs=True`` on one GPU (device machines): numerics equal the uncaptured compile,
training then ``no_grad`` evaluation, ``eval()``/``train()`` switches, new shapes.

Skipped without CUDA. The DDP cases (NCCL, split and fused) are in test_gpu_split.py.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch

import bucketwise
from bucketwise.launch.models import GPT, GPTConfig, synthetic_tokens

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CFG = GPTConfig(vocab=512, seq=32, layers=2, d_model=64, heads=4, dropout=0.0)


def _models():
    torch.manual_seed(0)
    base = GPT(CFG).cuda()
    plain, graphed = copy.deepcopy(base), copy.deepcopy(base)
    return (
        plain,
        bucketwise.compile(plain, backend="inductor", cudagraphs=False),
        graphed,
        bucketwise.compile(graphed, backend="inductor", cudagraphs=True),
    )


def _step(model, compiled, opt, x, y):
    opt.zero_grad(set_to_none=True)
    loss = compiled(x, y)
    loss.backward()
    opt.step()
    return loss.detach()


# Tolerances, not bit equality: the embedding backward accumulates with atomics (any order).


def _same_params(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_training_eval_and_shapes_equal_uncaptured():
    plain, c_plain, graphed, c_graphed = _models()
    opt_p = torch.optim.SGD(plain.parameters(), lr=0.1)
    opt_g = torch.optim.SGD(graphed.parameters(), lr=0.1)
    for step in range(6):
        x, y = synthetic_tokens(CFG, 4, seed=step, device="cuda")
        lp = _step(plain, c_plain, opt_p, x, y)
        lg = _step(graphed, c_graphed, opt_g, x, y)
        torch.testing.assert_close(lg, lp, rtol=1e-5, atol=1e-6)
    _same_params(plain, graphed)
    # Evaluation with the same compiled model, then eval()/train() switches, then training.
    x, y = synthetic_tokens(CFG, 4, seed=99, device="cuda")
    for _ in range(3):
        with torch.no_grad():
            torch.testing.assert_close(c_graphed(x, y), c_plain(x, y), rtol=1e-5, atol=1e-6)
    for m in (plain, graphed):
        m.eval()
    with torch.no_grad():
        kept = c_graphed(x, y)
        expect = kept.clone()
        for _ in range(3):
            torch.testing.assert_close(c_graphed(x, y), c_plain(x, y), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(kept, expect, rtol=1e-5, atol=1e-6)  # not overwritten by replays
    for m in (plain, graphed):
        m.train()
    for step in range(4):
        batch = 4 if step < 2 else 6  # a new shape: recompiled/re-recorded, same numerics
        x, y = synthetic_tokens(CFG, batch, seed=50 + step, device="cuda")
        torch.testing.assert_close(
            _step(graphed, c_graphed, opt_g, x, y), _step(plain, c_plain, opt_p, x, y), rtol=1e-5, atol=1e-6
        )
    _same_params(plain, graphed)
    rep = bucketwise.report(c_graphed)
    print(rep.table())
    fw = [c for c in rep.cudagraphs if c.name.endswith("forward")]
    assert fw and fw[0].captured and fw[0].replays >= 4, rep.table()
    assert any(c.name.endswith("inference") and c.replays >= 1 for c in rep.cudagraphs), rep.table()
    assert all(c.pool_bytes >= 0 for c in rep.cudagraphs)


def test_host_sync_segment_runs_uncaptured_with_reason():
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16).cuda()

    def f(x):
        y = lin(x)
        return y * (y.abs().max().item() > 0)  # host sync inside the graph region

    c = bucketwise.compile(f, backend="inductor", cudagraphs=True)
    x = torch.randn(4, 16, device="cuda", requires_grad=True)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):  # keep .item() in the graph
        for _ in range(3):
            torch.testing.assert_close(c(x), f(x))
    rep = bucketwise.report(c)
    print(rep.table())
    blocked = [s for s in rep.cudagraphs if s.reason and ("host" in s.reason or "data-dependent" in s.reason)]
    assert blocked and all(s.replays == 0 for s in blocked), rep.table()


def test_a_large_output_goes_out_uncopied_and_raises_once_its_recording_is_released():
    # The output (64 x 8,192 floats, 2 MiB) is the graph's own memory: a replay allocates nothing
    # for it. The backward reused that memory, so once the recordings are gone (the model dropped,
    # Dynamo's cache reset) a tensor still on it raises instead of reading freed memory.
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8192)).cuda()
    plain = copy.deepcopy(net)
    c_net = bucketwise.compile(net, backend="inductor", cudagraphs=True)
    for step in range(4):
        x = torch.randn(64, 256, device="cuda")
        before = torch.cuda.memory_allocated()
        out = c_net(x)
        grown = torch.cuda.memory_allocated() - before
        torch.testing.assert_close(out, plain(x), rtol=1e-4, atol=1e-4)
        if step >= 2:  # replayed
            assert grown < 2**20, f"step {step}: {grown} bytes allocated for the output: copied"
        loss = out.sum()
        del out
        loss.backward()
    del loss  # its autograd graph holds the compiled functions, and with them the recordings
    kept = c_net(torch.randn(64, 256, device="cuda")).detach()
    rep = bucketwise.report(c_net)
    assert all(g.uncaptured_runs == 0 for g in rep.cudagraphs), rep.table()
    del c_net, net
    torch._dynamo.reset()
    gc.collect()
    with pytest.raises(RuntimeError, match="bucketwise: this tensor was returned by a CUDA-graph replay"):
        kept.sum()
