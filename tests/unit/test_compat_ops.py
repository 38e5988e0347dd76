"""Operators with one Python call per call at run time (NOTE [one Python call per op]): the
kernel runs straight from the autograd key for plain tensors, and every other way in (fake
tensors, a dispatch mode, a gradient) still works as for ``torch.library.custom_op``."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bucketwise._compat import ops

_NAMES = itertools.count()


def _op(with_formula: bool):
    """``name(int scale, Tensor[] xs) -> Tensor[]``: ``[xs[0] * scale]``; records, per kernel
    call, whether it ran below autograd (a redispatch) or straight from the autograd key."""
    calls = []

    def kernel(scale: int, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        below = torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.AutogradCPU)
        calls.append("redispatched" if below else "direct")
        return [xs[0] * scale]

    def fake(scale: int, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [torch.empty_like(xs[0])]

    class Formula(torch.autograd.Function):
        @staticmethod
        def forward(ctx, scale, *xs):
            ctx.scale = scale
            return tuple(op(scale, list(xs)))

        @staticmethod
        def backward(ctx, grad):
            return None, grad * ctx.scale, None

    op = ops.define(
        f"bucketwise_test::op{next(_NAMES)}",
        "(int scale, Tensor[] xs) -> Tensor[]",
        kernel=kernel,
        fake=fake,
        formula=Formula if with_formula else None,
    )
    return op, calls


def test_plain_tensors_and_parameters_run_the_kernel_from_the_autograd_key():
    op, calls = _op(with_formula=True)
    x, p = torch.ones(3), torch.nn.Parameter(torch.ones(3))
    with torch.no_grad():
        (out,) = op(3, [x, p])
    assert torch.equal(out, torch.full((3,), 3.0)) and calls == ["direct"]


def test_the_formula_gives_the_gradient():
    op, calls = _op(with_formula=True)
    x = torch.ones(3, requires_grad=True)
    (out,) = op(2, [x, torch.zeros(3)])
    out.sum().backward()
    assert len(calls) == 1
    assert torch.equal(x.grad, torch.full((3,), 2.0))


def test_without_a_formula_a_gradient_is_refused_by_name():
    op, _ = _op(with_formula=False)
    with pytest.raises(RuntimeError, match=r"bucketwise_test::op\d+ has no autograd formula"):
        op(2, [torch.ones(3, requires_grad=True), torch.zeros(3)])


def test_fake_tensors_get_the_fake_kernel():
    from torch._subclasses.fake_tensor import FakeTensorMode

    op, calls = _op(with_formula=True)
    with FakeTensorMode() as mode:
        (out,) = op(2, [mode.from_tensor(torch.ones(3)), mode.from_tensor(torch.ones(3))])
    assert out.shape == (3,) and calls == []


def test_a_dispatch_mode_sees_the_operator():
    op, calls = _op(with_formula=True)
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Record():  # the mode is off while it runs the op: the kernel is then called directly
        (out,) = op(2, [torch.ones(3), torch.ones(3)])
    assert op in seen and torch.equal(out, torch.full((3,), 2.0)) and len(calls) == 1


def test_an_fx_trace_records_the_operator():
    from torch.fx.experimental.proxy_tensor import make_fx

    op, _ = _op(with_formula=True)
    gm = make_fx(lambda a, b: op(2, [a, b])[0] + 1, tracing_mode="fake")(torch.ones(3), torch.ones(3))
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"][0] is op


def test_a_tensor_subclass_goes_below_autograd_to_its_own_dispatch():
    """A subclass with ``__torch_dispatch__`` among the tensors puts the Python key in the call's
    key set: the kernel is not called on it directly; the subclass sees the operator and runs it
    on plain tensors (the kernel's one call)."""
    from torch.utils._pytree import tree_map

    seen = []

    class Wrapped(torch.Tensor):
        @staticmethod
        def __new__(cls, elem):
            return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)

        def __init__(self, elem):
            self.elem = elem

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            seen.append(func)
            unwrap = lambda t: t.elem if isinstance(t, Wrapped) else t  # noqa: E731
            return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))

    op, calls = _op(with_formula=True)
    with torch.no_grad():
        (out,) = op(2, [Wrapped(torch.ones(3)), torch.ones(3)])
    assert op in seen and calls == ["direct"] and torch.equal(out, torch.full((3,), 2.0))
