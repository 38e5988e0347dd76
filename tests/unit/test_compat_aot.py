"""``_compat/aot.py``: a shared block's compiled graphs, called through Inductor's wrapper once and
directly after (NOTE [a compiled block called directly])."""

from __future__ import annotations

import torch

from bucketwise._compat import aot


class _Compiled:
    """Stands in for Inductor's ``CompiledFxGraph``: counts calls of the wrapper and of the
    generated ``call``."""

    def __init__(self) -> None:
        self.wrapper_calls = self.direct_calls = 0

    def __call__(self, inputs):
        self.wrapper_calls += 1
        return self.current_callable(inputs)

    def current_callable(self, inputs):
        self.direct_calls += 1
        out = [t * 2 for t in inputs]
        inputs.clear()  # boxed: the callee empties the list
        return out


def test_the_wrapper_runs_once_then_the_generated_call():
    inner = _Compiled()
    fn = aot._DirectAfterFirst(inner)
    for _ in range(3):
        (out,) = fn([torch.ones(2)])
        assert torch.equal(out, torch.full((2,), 2.0))
    assert (inner.wrapper_calls, inner.direct_calls) == (1, 3)


def test_under_the_profiler_every_call_goes_through_the_wrapper():
    inner = _Compiled()
    fn = aot._DirectAfterFirst(inner)
    fn([torch.ones(2)])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        fn([torch.ones(2)])
        fn([torch.ones(2)])
    fn([torch.ones(2)])
    assert (inner.wrapper_calls, inner.direct_calls) == (3, 4)


def test_without_a_generated_call_every_call_goes_through_the_wrapper():
    class Plain:
        calls = 0

        def __call__(self, inputs):
            Plain.calls += 1
            return list(inputs)

    fn = aot._DirectAfterFirst(Plain())
    for _ in range(3):
        fn([torch.ones(1)])
    assert Plain.calls == 3


def _inductor_compile_function(fn, args):
    """``fn`` traced to aten ops on ``args`` and compiled as a shared block's graphs are."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    gm = make_fx(fn)(*args)
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())  # as Dynamo's: Inductor's FX-graph cache needs one
    fakes = [fake_mode.from_tensor(a) for a in args]
    for node, fake in zip(gm.graph.find_nodes(op="placeholder"), fakes):
        node.meta["val"] = fake
    return aot.inductor_compile(gm, fakes, fake_mode, backward=False, config_patches={})


def test_an_inductor_graph_called_directly_computes_what_it_did_through_the_wrapper():
    def f(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.relu(x @ y) + 1,)

    x, y = torch.randn(4, 4), torch.randn(4, 4)
    fn = _inductor_compile_function(f, [x, y])
    first, second = fn([x, y])[0], fn([x, y])[0]
    assert torch.equal(first, f(x, y)[0]) and torch.equal(second, first)
    assert fn._direct is not None  # the second call went to Inductor's generated code
