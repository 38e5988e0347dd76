"""The torch.compile programming model under bucketwise.compile, without DDP.

Functions and plain modules compiled by ``bucketwise.compile`` are compiled whole, like
``torch.compile``; these tests prove that what users write for ``torch.compile`` keeps working:

- torch.func transforms (``grad``, ``grad_and_value``, ``vmap``, ``vjp``, ``jvp``, ``jacrev``,
  ``jacfwd``, ``hessian``, ``functional_call`` and their compositions) are captured in one graph
  with ``fullgraph=True`` and give the same numbers as eager torch.func;
- the cases that older torch documented as falling back to eager for torch.func under compile
  (tuple inputs, keyword arguments, mutation of a list created outside the function, ``vmap``
  over ``stride()``/``is_contiguous()``), with what torch 2.13 really does for each (the table
  in docs/programming-model.md is filled from these assertions);
- NumPy code and ``torch.compiler.wrap_numpy``.

How capture is proven: torch 2.13's Dynamo inlines torch.func transforms instead of emitting a
higher-order op (the report's ``higher_order_ops`` stays empty for them); the transform shows
up as functorch's own calls in the FX graph (``_vmap_increment_nesting``, ``_grad_increment_
nesting``, ``_jvp_increment_nesting``, ...). A recording backend (aot_eager underneath, so the
numbers go through AOTAutograd) keeps every graph bucketwise hands it, and the tests look for
those calls. Where Dynamo does emit a higher-order op (activation checkpoint, ``torch.cond``
inside ``vmap``) the report must name it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint
from torch.func import (
    functional_call,
    grad,
    grad_and_value,
    hessian,
    jacfwd,
    jacrev,
    jvp,
    stack_module_state,
    vjp,
    vmap,
)

import bucketwise

RTOL, ATOL = 1e-5, 1e-6


# --- helpers -------------------------------------------------------------------------------


class Recorder:
    """A callable backend: keeps each graph it is handed, compiles it with aot_eager."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []
        self._aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self.graphs.append(gm)
        return self._aot_eager(gm, example_inputs)

    def call_names(self) -> list[str]:
        """Names of the functions called by the recorded graphs, in order (repeats kept)."""
        return [
            getattr(n.target, "__name__", str(n.target))
            for gm in self.graphs
            for n in gm.graph.nodes
            if n.op == "call_function"
        ]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed))


def _assert_one_graph(compiled: Any) -> Any:
    """One graph, no graph break, no fallback; returns the report."""
    rep = bucketwise.report(compiled)
    assert rep.totals["graphs"] == 1, rep.table()
    assert rep.totals["graph_breaks"] == 0, rep.table()
    assert rep.totals["fallbacks"] == 0, rep.table()
    assert rep.graphs[0].graph_break_reasons == [], rep.graphs[0].graph_break_reasons
    return rep


def _count(names: list[str], name: str) -> int:
    return sum(1 for n in names if n == name)


# --- 1. torch.func transforms captured whole -----------------------------------------------


class Small(nn.Module):
    """A small module with a buffer, for functional_call."""

    def __init__(self) -> None:
        super().__init__()
        self.l0 = nn.Linear(6, 8)
        self.l1 = nn.Linear(8, 3)
        self.register_buffer("shift", torch.linspace(-0.5, 0.5, 8))

    def forward(self, x: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
        return self.l1(torch.tanh(self.l0(x) + self.shift)) / temperature


def _small() -> Small:
    torch.manual_seed(0)
    return Small()


def _detached(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in module.named_parameters()}


def _sin_sum(x: torch.Tensor) -> torch.Tensor:
    return (x.sin() * x).sum()


@dataclasses.dataclass
class FuncCase:
    fn: Callable[..., Any]
    args: Callable[[], tuple]
    kwargs: Callable[[], dict] = dict
    needs: dict[str, int] = dataclasses.field(default_factory=dict)
    """functorch call -> minimal number of occurrences in the captured graph."""
    hops: tuple[str, ...] = ()
    """higher-order ops the report must name."""
    reference: Callable[..., Any] | None = None
    """What the result must equal, where running ``fn`` eagerly is not the reference (default: ``fn``)."""


def _grad_case() -> FuncCase:
    return FuncCase(
        lambda x: grad(_sin_sum)(x), lambda: (_randn(5),), needs={"_grad_increment_nesting": 1, "_autograd_grad": 1}
    )


def _grad_argnums_aux_case() -> FuncCase:
    # Tuple of differentiated inputs, a dict auxiliary output.
    def loss(w, b, x):
        y = torch.tanh(x @ w + b)
        return y.square().mean(), {"y": y, "norm": y.norm()}

    return FuncCase(
        lambda w, b, x: grad(loss, argnums=(0, 1), has_aux=True)(w, b, x),
        lambda: (_randn(4, 3, seed=1), _randn(3, seed=2), _randn(5, 4, seed=3)),
        needs={"_grad_increment_nesting": 1},
    )


def _grad_and_value_case() -> FuncCase:
    return FuncCase(lambda x: grad_and_value(_sin_sum)(x), lambda: (_randn(5),), needs={"_grad_increment_nesting": 1})


def _vmap_dims_case() -> FuncCase:
    # Batch along dim 1 of x, w unbatched (None), the batch put at dim 1 of the output.
    return FuncCase(
        lambda x, w: vmap(lambda xi, w: torch.tanh(w @ xi), in_dims=(1, None), out_dims=1)(x, w),
        lambda: (_randn(4, 7, seed=1), _randn(3, 4, seed=2)),
        needs={"_vmap_increment_nesting": 1, "_add_batch_dim": 1, "_remove_batch_dim": 1},
    )


def _nested_vmap_case() -> FuncCase:
    return FuncCase(
        lambda x, y: vmap(vmap(lambda a, b: (a * b).sum(), in_dims=(0, None)), in_dims=(None, 0))(x, y),
        lambda: (_randn(3, 5, seed=1), _randn(4, 5, seed=2)),
        needs={"_vmap_increment_nesting": 2, "_vmap_decrement_nesting": 2},
    )


def _vmap_pytree_case() -> FuncCase:
    # A dict of tensors in, a tuple (tensor, dict) out.
    def per_sample(d):
        s = d["a"] * d["b"].sum()
        return s.cos(), {"max": s.max(), "s": s}

    return FuncCase(
        lambda d: vmap(per_sample)(d),
        lambda: ({"a": _randn(4, 3, seed=1), "b": _randn(4, 2, seed=2)},),
        needs={"_vmap_increment_nesting": 1},
    )


def _vjp_case() -> FuncCase:
    def fn(x, v):
        out, pullback = vjp(lambda t: t.sin() * t.cos().sum(), x)
        return out, pullback(v)

    return FuncCase(fn, lambda: (_randn(5, seed=1), _randn(5, seed=2)), needs={"_grad_increment_nesting": 1})


def _jvp_case() -> FuncCase:
    return FuncCase(
        lambda x, v: jvp(lambda t: t.sin() * t.sum(), (x,), (v,)),
        lambda: (_randn(5, seed=1), _randn(5, seed=2)),
        needs={"_jvp_increment_nesting": 1, "_make_dual": 1},
    )


def _jacrev_case() -> FuncCase:
    return FuncCase(
        lambda x: jacrev(lambda t: t.sin() * t.sum())(x),
        lambda: (_randn(5),),
        needs={"_grad_increment_nesting": 1, "_vmap_increment_nesting": 1},
    )


def _jacfwd_case() -> FuncCase:
    return FuncCase(
        lambda x: jacfwd(lambda t: t.sin() * t.sum())(x),
        lambda: (_randn(5),),
        needs={"_jvp_increment_nesting": 1, "_vmap_increment_nesting": 1},
    )


def _hessian_case() -> FuncCase:
    return FuncCase(
        lambda x: hessian(_sin_sum)(x),
        lambda: (_randn(4),),
        needs={"_jvp_increment_nesting": 1, "_grad_increment_nesting": 1, "_vmap_increment_nesting": 1},
    )


_SMALL = _small()


def _functional_call_case() -> FuncCase:
    # Parameters and buffers as two dicts, a keyword argument for the module's forward.
    def fn(params, buffers, x):
        return functional_call(_SMALL, (params, buffers), (x,), {"temperature": 2.0})

    return FuncCase(
        fn,
        lambda: (_detached(_SMALL), {"shift": torch.full((8,), 0.25)}, _randn(5, 6)),
        needs={"linear": 2},
    )


def _per_sample_loss(params, x, y):
    logits = functional_call(_SMALL, params, (x.unsqueeze(0),))
    return F.cross_entropy(logits, y.unsqueeze(0))


def _per_sample_grads_case() -> FuncCase:
    # The DP-SGD building block: per-sample gradients of a module's loss.
    return FuncCase(
        lambda params, x, y: vmap(grad(_per_sample_loss), in_dims=(None, 0, 0))(params, x, y),
        lambda: (_detached(_SMALL), _randn(7, 6), torch.randint(0, 3, (7,), generator=_gen(1))),
        needs={"_vmap_increment_nesting": 1, "_grad_increment_nesting": 1, "_autograd_grad": 1},
    )


def _closure_over_module_case() -> FuncCase:
    # No parameters passed in: the compiled function closes over the module and reads its
    # parameters itself (detached, as torch.func wants), then per-sample grads + values.
    def fn(x, y):
        params = {k: v.detach() for k, v in _SMALL.named_parameters()}
        return vmap(grad_and_value(_per_sample_loss), in_dims=(None, 0, 0))(params, x, y)

    return FuncCase(
        fn,
        lambda: (_randn(7, 6), torch.randint(0, 3, (7,), generator=_gen(1))),
        needs={"_vmap_increment_nesting": 1, "_grad_increment_nesting": 1},
    )


def _ensemble_case() -> FuncCase:
    # Model ensembling: stack_module_state + vmap over functional_call.
    torch.manual_seed(1)
    models = [Small() for _ in range(3)]
    params, buffers = stack_module_state(models)
    base = Small().to("meta")

    def fn(params, buffers, x):
        return vmap(lambda p, b, x: functional_call(base, (p, b), (x,)), in_dims=(0, 0, None))(params, buffers, x)

    return FuncCase(fn, lambda: (params, buffers, _randn(5, 6)), needs={"_vmap_increment_nesting": 1})


def _keyword_args_case() -> FuncCase:
    # Keyword arguments to the transformed functions (grad differentiates the positional one,
    # vmap passes keyword arguments through unbatched).
    def fn(x, y):
        g = grad(lambda a, *, scale: (a * scale).sin().sum())(x, scale=y)
        v = vmap(lambda a, *, b: a * b)(x, b=y[0])
        return g, v

    return FuncCase(
        fn,
        lambda: (_randn(3, 4, seed=1), _randn(3, 4, seed=2)),
        needs={"_grad_increment_nesting": 1, "_vmap_increment_nesting": 1},
    )


def _vmap_checkpoint_case() -> FuncCase:
    # Dynamo emits a higher-order op for activation checkpointing, also inside vmap. torch 2.11's
    # eager vmap refuses checkpoint (its _NoopSaveInputs has no vmap rule); compiled it runs.
    return FuncCase(
        lambda x: vmap(lambda t: checkpoint.checkpoint(lambda u: u.sin().cos() * u, t, use_reentrant=False))(x),
        lambda: (_randn(3, 4),),
        needs={"_vmap_increment_nesting": 1},
        hops=("tag_activation_checkpoint",),
        reference=lambda x: vmap(lambda u: u.sin().cos() * u)(x),
    )


def _vmap_cond_case() -> FuncCase:
    # torch.cond (a higher-order op) under vmap: the per-sample predicate picks the branch.
    return FuncCase(
        lambda x: vmap(lambda t: torch.cond(t.sum() > 0, lambda u: u.sin(), lambda u: u.cos() - 2.0, (t,)))(x),
        lambda: (_randn(6, 4),),
        needs={"_vmap_increment_nesting": 1},
        hops=("cond",),
    )


FUNC_CASES: dict[str, Callable[[], FuncCase]] = {
    "grad": _grad_case,
    "grad_argnums_has_aux": _grad_argnums_aux_case,
    "grad_and_value": _grad_and_value_case,
    "vmap_in_dims_out_dims": _vmap_dims_case,
    "nested_vmap": _nested_vmap_case,
    "vmap_pytree_in_out": _vmap_pytree_case,
    "vjp": _vjp_case,
    "jvp": _jvp_case,
    "jacrev": _jacrev_case,
    "jacfwd": _jacfwd_case,
    "hessian": _hessian_case,
    "functional_call": _functional_call_case,
    "per_sample_grads": _per_sample_grads_case,
    "closure_over_module_params": _closure_over_module_case,
    "ensemble_stack_module_state": _ensemble_case,
    "keyword_args": _keyword_args_case,
    "vmap_checkpoint_hop": _vmap_checkpoint_case,
    "vmap_cond_hop": _vmap_cond_case,
}


@pytest.mark.parametrize("name", list(FUNC_CASES))
def test_functorch_captured_in_one_graph(name):
    case = FUNC_CASES[name]()
    args, kwargs = case.args(), case.kwargs()
    expected = (case.reference or case.fn)(*args, **kwargs)

    rec = Recorder()
    compiled = bucketwise.compile(case.fn, backend=rec, fullgraph=True)
    actual = compiled(*args, **kwargs)
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL)
    # Second call: served from the cache, no recompile, same numbers.
    torch.testing.assert_close(compiled(*args, **kwargs), expected, rtol=RTOL, atol=ATOL)

    rep = _assert_one_graph(compiled)
    assert rep.totals["recompiles"] == 0, rep.table()
    assert len(rec.graphs) == 1
    names = rec.call_names()
    for fn_name, n in case.needs.items():
        assert _count(names, fn_name) >= n, f"{fn_name} x{n} not in the captured graph: {names}"
    for hop in case.hops:
        assert hop in rep.graphs[0].higher_order_ops, rep.graphs[0].higher_order_ops


def test_per_sample_grads_match_per_sample_autograd():
    """vmap(grad) per-sample gradients equal a loop of torch.autograd.grad, one sample at a time."""
    params = _detached(_SMALL)
    x, y = _randn(5, 6), torch.randint(0, 3, (5,), generator=_gen(1))
    compiled = bucketwise.compile(
        lambda p, x, y: vmap(grad(_per_sample_loss), in_dims=(None, 0, 0))(p, x, y), backend="aot_eager", fullgraph=True
    )
    per_sample = compiled(params, x, y)
    _assert_one_graph(compiled)
    for i in range(len(x)):
        p = {k: v.clone().requires_grad_() for k, v in params.items()}
        loss = _per_sample_loss(p, x[i], y[i])
        gs = torch.autograd.grad(loss, list(p.values()))
        for (k, _), g in zip(p.items(), gs):
            torch.testing.assert_close(per_sample[k][i], g, rtol=RTOL, atol=ATOL, msg=lambda m: f"sample {i} {k}: {m}")


class VmapModule(nn.Module):
    """A plain module whose forward maps a per-sample function of its own parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Small()
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = dict(self.inner.named_parameters())

        def per_sample(xi):
            return functional_call(self.inner, params, (xi,)) * self.gate

        out = vmap(per_sample)(x)
        # jvp of the output in a fixed direction, differentiable w.r.t. the parameters.
        _, tangent = jvp(lambda t: vmap(per_sample)(t), (x,), (torch.ones_like(x),))
        return out + 0.1 * tangent


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_plain_module_training_through_vmap_and_jvp(backend):
    """bucketwise.compile(nn.Module): vmap/jvp/functional_call in the forward, backward
    through them; losses, gradients and parameters equal eager for 3 SGD steps."""
    torch.manual_seed(0)
    eager = VmapModule()
    cmod = VmapModule()
    cmod.load_state_dict(eager.state_dict())
    compiled = bucketwise.compile(cmod, backend=backend, fullgraph=True)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_c = torch.optim.SGD(compiled.parameters(), lr=0.1)
    rtol, atol = (RTOL, ATOL) if backend == "aot_eager" else (1e-4, 1e-5)
    for step in range(3):
        x = _randn(4, 6, seed=10 + step)
        loss_e = eager(x).square().mean()
        loss_c = compiled(x).square().mean()
        loss_e.backward()
        loss_c.backward()
        torch.testing.assert_close(loss_c, loss_e, rtol=rtol, atol=atol)
        for (n, p), q in zip(eager.named_parameters(), compiled.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=rtol, atol=atol, msg=lambda m: f"step {step} grad {n}: {m}")
        opt_e.step()
        opt_c.step()
        opt_e.zero_grad()
        opt_c.zero_grad()
        for (n, p), q in zip(eager.named_parameters(), compiled.parameters()):
            torch.testing.assert_close(q, p, rtol=rtol, atol=atol, msg=lambda m: f"step {step} param {n}: {m}")
    rep = _assert_one_graph(compiled)
    assert rep.totals["recompiles"] == 0


@pytest.mark.inductor
@pytest.mark.parametrize("name", ["per_sample_grads", "jacrev"])
def test_functorch_with_inductor(name):
    case = FUNC_CASES[name]()
    args = case.args()
    compiled = bucketwise.compile(case.fn, backend="inductor", fullgraph=True)
    torch.testing.assert_close(compiled(*args), case.fn(*args), rtol=1e-4, atol=1e-5)
    rep = _assert_one_graph(compiled)
    assert rep.graphs[0].segments[0].backend == "inductor"


# --- 2. what older torch documented as unsupported for torch.func under compile ----------
#
# Each case: what torch 2.13 does under bucketwise.compile, with fullgraph=True and without.
# docs/programming-model.md tabulates exactly these assertions.


def _tuple_input(xy):
    return vmap(lambda t: t[0] * t[1].cos())(xy), grad(lambda t: (t[0] * t[1].cos()).sum())(xy)


def _tuple_and_dict_outputs(x):
    per_sample = vmap(lambda t: (t.sin(), {"c": t.cos(), "s": t.sum()}))(x)
    g, aux = grad(lambda t: (t.sin().sum(), {"norm": t.norm()}), has_aux=True)(x)
    return per_sample, (g, aux)


def _keyword_arguments(x, y):
    return grad(lambda a, scale: (a * scale).sin().sum())(x, scale=y), vmap(lambda a, b: a * b)(x, b=y)


def _vmap_stride_and_contiguity(x):
    # Per-sample views of x: stride (1,) and contiguous with in_dims=0, stride (4,) and not
    # contiguous with in_dims=1; the results depend on both queries.
    def per_sample(t):
        scale = t.stride()[0]
        return t * scale if t.is_contiguous() else -t * scale

    return vmap(per_sample, in_dims=0)(x), vmap(per_sample, in_dims=1)(x)


CAPTURED_HISTORICAL = {
    "tuple_input": (_tuple_input, lambda: ((_randn(3, 4, seed=1), _randn(3, 4, seed=2)),)),
    "tuple_and_dict_outputs": (_tuple_and_dict_outputs, lambda: (_randn(3, 4),)),
    "keyword_arguments": (_keyword_arguments, lambda: (_randn(3, 4, seed=1), _randn(3, 4, seed=2))),
    "vmap_stride_is_contiguous": (_vmap_stride_and_contiguity, lambda: (_randn(3, 4),)),
}


@pytest.mark.parametrize("fullgraph", [True, False])
@pytest.mark.parametrize("name", list(CAPTURED_HISTORICAL))
def test_historically_unsupported_now_captured(name, fullgraph):
    fn, make_args = CAPTURED_HISTORICAL[name]
    args = make_args()
    expected = fn(*args)
    rec = Recorder()
    compiled = bucketwise.compile(fn, backend=rec, fullgraph=fullgraph)
    torch.testing.assert_close(compiled(*args), expected, rtol=RTOL, atol=ATOL)
    _assert_one_graph(compiled)
    names = rec.call_names()
    assert "_vmap_increment_nesting" in names or "_grad_increment_nesting" in names, names


def test_vmap_stride_queries_see_per_sample_layout():
    """The compiled per-sample stride/contiguity are the eager ones (not the batched tensor's)."""
    x = _randn(3, 4)
    out0, out1 = bucketwise.compile(_vmap_stride_and_contiguity, backend="aot_eager", fullgraph=True)(x)
    torch.testing.assert_close(out0, x * 1)  # stride (1,), contiguous
    torch.testing.assert_close(out1, -x.T * 4)  # stride (4,), not contiguous


@pytest.mark.parametrize("transform", ["grad", "vmap"])
@pytest.mark.parametrize("fullgraph", [True, False])
def test_mutating_outer_list_with_python_values(transform, fullgraph):
    """Appending Python values to a list created outside the transformed function: captured,
    the append replayed exactly as eager does it."""

    def make(seen: list):
        def f(t):
            seen.append(("called", tuple(t.shape)))
            return t.sin().sum() if transform == "grad" else t.sin()

        def fn(x):
            return grad(f)(x) if transform == "grad" else vmap(f)(x)

        return fn

    compiled, seen_compiled, seen_eager = _eager_then_compiled(make, fullgraph)
    _assert_one_graph(compiled)
    assert seen_compiled == seen_eager, (seen_compiled, seen_eager)


def _eager_then_compiled(make, fullgraph: bool):
    """Run ``make(seen)`` eagerly and compiled on one input, check the results agree, and return
    (compiled, what the compiled run appended to its list, what the eager run appended)."""
    x = _randn(3, 4)
    seen_eager: list = []
    expected = make(seen_eager)(x)
    seen: list = []
    compiled = bucketwise.compile(make(seen), backend="aot_eager", fullgraph=fullgraph)
    torch.testing.assert_close(compiled(x), expected)
    return compiled, seen, seen_eager


def _escaping(seen: list):
    def fn(x):
        def f(t):
            seen.append(t.sum())  # a batched tensor escapes the vmap (a user error in eager too)
            return t.sin()

        return vmap(f)(x)

    return fn


@pytest.mark.parametrize("fullgraph", [True, False])
def test_mutating_outer_list_with_escaping_tensor(fullgraph):
    """Appending a per-sample *tensor* to a list created outside: Dynamo captures it (no graph
    break, fullgraph=True passes), AOTAutograd cannot compile it; with fallback="eager" the
    captured graph runs eagerly (one fallback in the report) and returns eager's result."""
    compiled, seen, seen_eager = _eager_then_compiled(_escaping, fullgraph)
    rep = bucketwise.report(compiled)
    assert rep.totals["graphs"] == 1 and rep.totals["graph_breaks"] == 0, rep.table()
    assert rep.totals["fallbacks"] == 1, rep.table()
    reason = rep.graphs[0].segments[0].reason
    assert "Cannot access storage of BatchedTensorImpl" in reason, reason
    # What escaped is the same thing eager leaks: a tensor still wrapped for vmap level 1.
    assert len(seen) == len(seen_eager) == 1
    assert "BatchedTensor" in repr(seen[0]) and "BatchedTensor" in repr(seen_eager[0])


@pytest.mark.parametrize("fullgraph", [True, False])
def test_mutating_outer_list_with_escaping_tensor_fallback_raise(fullgraph):
    """With fallback="raise" the backend failure surfaces like plain torch.compile's."""
    x = _randn(3, 4)
    compiled = bucketwise.compile(_escaping([]), backend="aot_eager", fullgraph=fullgraph, fallback="raise")
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="Cannot access storage of BatchedTensorImpl"):
        compiled(x)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="Cannot access storage of BatchedTensorImpl"):
        torch.compile(_escaping([]), backend="aot_eager", fullgraph=fullgraph)(x)


def _grad_of_checkpoint(x):
    # Unsupported by torch.func itself (eager raises): grad over activation checkpointing.
    return grad(lambda t: checkpoint.checkpoint(lambda u: u.sin().cos(), t, use_reentrant=False).sum())(x)


def _plain_torch_compile(fn: Callable[..., Any], *args: Any) -> tuple[Any, Exception | None]:
    """``torch.compile(fn, backend="aot_eager")(*args)``: (result, None) or (None, its error)."""
    torch._dynamo.reset()
    try:
        return torch.compile(fn, backend="aot_eager")(*args), None
    except Exception as exc:  # noqa: BLE001 - the outcome under comparison
        return None, exc
    finally:
        torch._dynamo.reset()


def test_failure_inside_transform_fallback_raise():
    """A backend failure while AOTAutograd traces inside a transform surfaces like plain
    torch.compile's with fallback="raise" (and eager raises the same error). torch 2.11 compiles
    this one (where its eager mode refuses it): bucketwise then gives torch.compile's result."""
    x = _randn(3, 4)
    with pytest.raises(RuntimeError, match="don't yet support saved tensor hooks"):
        _grad_of_checkpoint(x)
    plain, plain_error = _plain_torch_compile(_grad_of_checkpoint, x)
    compiled = bucketwise.compile(_grad_of_checkpoint, backend="aot_eager", fallback="raise")
    if plain_error is None:
        torch.testing.assert_close(compiled(x), plain)
        return
    assert "don't yet support saved tensor hooks" in str(plain_error), plain_error
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="don't yet support saved tensor hooks"):
        compiled(x)


def test_failure_inside_transform_fallback_eager():
    """A compile that fails inside a torch.func transform cannot fall back (functorch state is
    left behind): bucketwise re-raises, with the transform's own error, like torch.compile (or,
    where torch compiles it, gives torch.compile's result)."""
    x = _randn(3, 4)
    plain, plain_error = _plain_torch_compile(_grad_of_checkpoint, x)
    compiled = bucketwise.compile(_grad_of_checkpoint, backend="aot_eager")
    if plain_error is None:
        torch.testing.assert_close(compiled(x), plain)
        return
    with pytest.raises(RuntimeError, match="don't yet support saved tensor hooks"):
        compiled(x)


# --- 6. NumPy ------------------------------------------------------------------------------


def _numpy_fn(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sin(a) ** 2 + np.cos(b).sum(axis=0) * a.mean() - np.maximum(a, 0.1)


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_numpy_function(backend):
    rng = np.random.RandomState(0)
    a, b = rng.randn(4, 5), rng.randn(3, 5)
    compiled = bucketwise.compile(_numpy_fn, backend=backend, fullgraph=True)
    out = compiled(a, b)
    expected = _numpy_fn(a, b)
    assert isinstance(out, np.ndarray), type(out)
    assert out.dtype == expected.dtype == np.float64
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)
    _assert_one_graph(compiled)


@torch.compiler.wrap_numpy
def _wrapped_numpy(x, y):
    return np.tanh(x @ y.T).sum(axis=1) ** 2 + np.exp(-np.abs(x)).mean()


def test_wrap_numpy_tensors_and_gradients():
    """wrap_numpy: tensors in, tensors out, and gradients flow back through the NumPy code."""
    x = _randn(4, 5, seed=1).requires_grad_()
    y = _randn(3, 5, seed=2).requires_grad_()
    compiled = bucketwise.compile(_wrapped_numpy, backend="aot_eager", fullgraph=True)
    out = compiled(x, y)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32, type(out)
    _assert_one_graph(compiled)
    (out * torch.arange(1.0, 5.0)).sum().backward()

    # Eager reference: the same computation in torch (eager wrap_numpy runs NumPy, no autograd).
    xr, yr = x.detach().clone().requires_grad_(), y.detach().clone().requires_grad_()
    ref = torch.tanh(xr @ yr.T).sum(1) ** 2 + torch.exp(-xr.abs()).mean()
    (ref * torch.arange(1.0, 5.0)).sum().backward()
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(x.grad, xr.grad, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(y.grad, yr.grad, rtol=RTOL, atol=ATOL)
    # Eager wrap_numpy gives the same values (through NumPy).
    torch.testing.assert_close(_wrapped_numpy(x.detach(), y.detach()), ref.detach(), rtol=RTOL, atol=ATOL)


@pytest.mark.inductor
def test_dynamic_true_with_inductor_compiles_without_fallback():
    # Dynamo restarts analysis through the backend under dynamic shapes
    # (TensorifyScalarRestartAnalysis); bucketwise must re-raise it, not fall back to eager.
    import bucketwise

    m = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh())
    c = bucketwise.compile(m, backend="inductor", dynamic=True, fallback="raise")
    for n in (4, 5, 6):
        x = torch.randn(n, 8)
        torch.testing.assert_close(c(x), m(x))
    rep = bucketwise.report(c)
    assert rep.totals["fallbacks"] == 0 and all(s.backend == "inductor" for g in rep.graphs for s in g.segments)
