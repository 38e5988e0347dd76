"""bucketwise's CUDA-graph wrapper (``cudagraphs=True``): the decisions, on CPU.

The policy (when to wrap, which graphs cannot be captured and why) is tested directly. The
runner (warm-up, record, replay, re-record, fallbacks, output protection) runs end to end with
Inductor on CPU through an emulated graph backend that keeps what matters of a real CUDA graph:
capture runs nothing, and a replay overwrites the very tensors the capture returned (see
tests/support/cudagraph_emulator.py). Every test compares numerics with the uncompiled model. The real
thing (NCCL, CUDA) is tested by tests/gpu/ on the device machines.
"""

from __future__ import annotations

import copy
import functools
import gc

import pytest
import torch
import torch.nn as nn
from support.cudagraph_emulator import use_emulated_graphs
from support.ddp_cases import train_and_compare
from support.dist import run_distributed
from torch.fx.experimental.proxy_tensor import make_fx

import bucketwise
from bucketwise._compat.capabilities import capabilities
from bucketwise.cudagraphs import policy, recording
from bucketwise.cudagraphs.recording import plan_inputs
from bucketwise.cudagraphs.runner import MAX_RECORDS

pytestmark = pytest.mark.inductor


# --- compile-level decision -------------------------------------------------------------


def test_resolve_matrix():
    r = functools.partial(policy.resolve, backend=capabilities("inductor"), mode=None, dynamic=None)
    assert r(False, cuda=True) == policy.Decision(enabled=False)
    assert r(True, cuda=True).enabled and r("auto", cuda=True).enabled
    off = r(True, cuda=False)
    assert not off.enabled and "no CUDA" in off.reason
    auto_dyn = policy.resolve("auto", cuda=True, backend=capabilities("inductor"), mode=None, dynamic=True)
    assert not auto_dyn.enabled and "dynamic" in auto_dyn.reason
    assert policy.resolve(True, cuda=True, backend=capabilities("inductor"), mode=None, dynamic=True).enabled
    assert not policy.resolve("auto", cuda=True, backend=capabilities("aot_eager"), mode=None, dynamic=None).enabled
    with pytest.raises(ValueError, match="backend 'aot_eager'"):
        policy.resolve(True, cuda=True, backend=capabilities("aot_eager"), mode=None, dynamic=None)
    with pytest.raises(ValueError, match="reduce-overhead"):
        policy.resolve(True, cuda=False, backend=capabilities("inductor"), mode="reduce-overhead", dynamic=None)


def test_contradictory_request_is_rejected_before_compiling():
    with pytest.raises(ValueError, match="cudagraphs=True and mode='reduce-overhead'"):
        bucketwise.compile(nn.Linear(2, 2), cudagraphs=True, mode="reduce-overhead")


# --- graph-level blockers ----------------------------------------------------------------


def _graph(fn, *args):
    return make_fx(fn)(*args)


def test_host_sync_blocks_capture():
    gm = make_fx(lambda x: x * x.sum().item(), tracing_mode="symbolic")(torch.randn(4))
    reasons = policy.capture_blockers(gm, [torch.randn(4)], device_type="cpu")
    assert any("_local_scalar_dense" in r and "host" in r for r in reasons), reasons


def test_data_dependent_shape_blocks_capture():
    gm = make_fx(lambda x: torch.nonzero(x), tracing_mode="symbolic")(torch.randn(4))
    reasons = policy.capture_blockers(gm, [torch.randn(4)], device_type="cpu")
    assert reasons and any("nonzero" in r or "data-dependent" in r for r in reasons), reasons


def test_mutated_inputs_are_found():
    def f(buf, x):
        buf.add_(1)
        return x * 2

    gm = _graph(f, torch.zeros(3), torch.randn(3))
    assert policy.mutated_placeholders(gm) == {0: "aten.add_"}


def test_off_device_tensor_blocks_capture():
    gm = _graph(lambda x: x + 1, torch.randn(3))
    assert policy.capture_blockers(gm, [torch.randn(3)], device_type="cpu") == []
    reasons = policy.capture_blockers(gm, [torch.randn(3)])  # replay device: cuda
    assert reasons and reasons[0] == "input 0 is a cpu tensor", reasons


# --- the runner, end to end on CPU (emulated graphs) --------------------------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.b = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.bn(self.a(x))))


def _pair(**kw):
    torch.manual_seed(0)
    ref = Net()
    mod = copy.deepcopy(ref)
    return ref, mod, bucketwise.compile(mod, backend="inductor", cudagraphs=True, **kw)


def _stats(compiled) -> dict[str, dict]:
    return {c.name: c.to_dict() for c in bucketwise.report(compiled).cudagraphs}


def _train(ref, mod, compiled, steps, *, batch=lambda i: 6, zero=True, micro=1):
    """``steps`` optimizer steps of ``micro`` accumulated backwards each; then
    ``zero_grad()`` (``set_to_none=True``) unless ``zero`` is false."""
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_c = torch.optim.SGD(mod.parameters(), lr=0.1)
    for i in range(steps):
        for _ in range(micro):
            x = torch.randn(batch(i), 8)
            ref(x).pow(2).mean().backward()
            compiled(x).pow(2).mean().backward()
        for p, q in zip(ref.parameters(), mod.parameters()):
            torch.testing.assert_close(q.grad, p.grad, msg=lambda m: f"step {i}: {m}")
        opt_r.step()
        opt_c.step()
        if zero:
            opt_r.zero_grad()
            opt_c.zero_grad()
    torch.testing.assert_close(dict(mod.state_dict()), dict(ref.state_dict()))


def test_training_replays_and_matches_eager(monkeypatch):
    emulators = use_emulated_graphs(monkeypatch)
    ref, mod, compiled = _pair()
    _train(ref, mod, compiled, 5)
    stats = _stats(compiled)
    fw, bw = stats["graph 0 segment 0 forward"], stats["graph 0 segment 0 backward"]
    # Step 1 warms up, step 2 records (and replays), steps 3-5 replay.
    for s in (fw, bw):
        assert (s["warmups"], s["records"], s["replays"], s["uncaptured_runs"]) == (1, 1, 4, 0), s
        assert s["captured"] and s["reason"] is None
    # Parameters and buffers are read in place; only the batch is copied. The backward reads
    # the forward's saved activations in place too; it copies only the incoming gradient.
    assert fw["inputs_copied"] == 1 and fw["inputs_in_place"] >= 6, fw
    assert bw["inputs_copied"] == 1, bw
    assert emulators[0].captures == 2 and emulators[0].replays == 8
    rep = bucketwise.report(compiled)
    assert "cuda graph" in rep.table() and rep.to_dict()["cudagraphs"][0]["name"] == "graph 0 segment 0 forward"


def test_evaluation_after_training_and_mode_switches(monkeypatch):
    use_emulated_graphs(monkeypatch)
    ref, mod, compiled = _pair()
    _train(ref, mod, compiled, 3)
    x = torch.randn(5, 8)
    for _ in range(3):
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), ref(x))
    for m in (ref, mod):
        m.eval()
    for _ in range(3):
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), ref(x))
    for m in (ref, mod):
        m.train()
    _train(ref, mod, compiled, 3)
    stats = _stats(compiled)
    inference = [s for n, s in stats.items() if n.endswith("inference")]
    assert inference and all(s["replays"] >= 1 for s in inference), stats
    # Outputs handed to the caller are copies: a kept result is not overwritten by later replays.
    with torch.no_grad():
        first = compiled(x)
        kept = first.clone()
        compiled(torch.randn(5, 8))
    torch.testing.assert_close(first, kept)


def test_two_forwards_before_backward_do_not_overwrite_saved_activations(monkeypatch):
    use_emulated_graphs(monkeypatch)
    ref, mod, compiled = _pair()
    _train(ref, mod, compiled, 3)  # recorded and replaying
    x1, x2 = torch.randn(6, 8), torch.randn(6, 8)
    (ref(x1).sum() + 2 * ref(x2).sum()).backward()
    (compiled(x1).sum() + 2 * compiled(x2).sum()).backward()
    for p, q in zip(ref.parameters(), mod.parameters()):
        torch.testing.assert_close(q.grad, p.grad)
    fw = _stats(compiled)["graph 0 segment 0 forward"]
    assert fw["uncaptured_runs"] >= 1 and any("still in use" in r for r in fw["uncaptured_reasons"]), fw


def test_gradient_accumulation_matches_eager(monkeypatch):
    use_emulated_graphs(monkeypatch)
    ref, mod, compiled = _pair()
    _train(ref, mod, compiled, 6, zero=False)  # gradients accumulate across steps


def test_replayed_gradients_are_stolen_not_copied(monkeypatch):
    # AccumulateGrad copies a gradient that someone else references; the runner lends aliases
    # of its static outputs, so param.grad *is* the backward graph's output memory.
    emulators = use_emulated_graphs(monkeypatch)
    ref, mod, compiled = _pair()
    _train(ref, mod, compiled, 3)
    x = torch.randn(6, 8)
    compiled(x).pow(2).mean().backward()
    ref(x).pow(2).mean().backward()
    for p, q in zip(ref.parameters(), mod.parameters()):
        assert q.grad.data_ptr() in emulators[0].output_ptrs, "gradient was copied out of the graph's output"
        torch.testing.assert_close(q.grad, p.grad)


def _trained_lending(monkeypatch):
    """Emulated graphs lending every returned output (the test's are small), a pair trained 3
    steps: (the emulators, eager DDP, the DDP module compiled, its compiled object)."""
    emulators = use_emulated_graphs(monkeypatch)
    monkeypatch.setattr(recording, "LEND_MIN_BYTES", 0)
    ref, mod, compiled = _pair()
    _train(ref, mod, compiled, 3)
    return emulators, ref, mod, compiled


def _same_grads_then_none(ref, mod):
    for p, q in zip(ref.parameters(), mod.parameters()):
        torch.testing.assert_close(q.grad, p.grad)
        p.grad = q.grad = None


def test_returned_outputs_go_out_uncopied_when_dropped_before_the_next_replay(monkeypatch):
    # The loss is taken and the output dropped before the backward (HF Trainer's compute_loss,
    # the benchmarks' steps): the output is the forward graph's own memory, never a clone.
    emulators, ref, mod, compiled = _trained_lending(monkeypatch)
    for _ in range(2):
        x = torch.randn(6, 8)
        out, expected = compiled(x), ref(x)
        assert out.data_ptr() in emulators[0].output_ptrs, "the returned output was cloned"
        torch.testing.assert_close(out, expected)
        loss = out.pow(2).mean()
        del out
        loss.backward()
        expected.pow(2).mean().backward()
        _same_grads_then_none(ref, mod)
    for s in _stats(compiled).values():
        assert s["uncaptured_runs"] == 0 and s["replays"] == 4, s


def test_an_output_kept_across_steps_keeps_its_values_and_is_cloned_from_then_on(monkeypatch):
    # A hand-written loop that keeps the output through the backward and while the next forward
    # runs (``out = model(x)`` rebinds only after the call): neither the backward, which reuses
    # the output's memory, nor the next forward may replay over it. The first backward that finds
    # it held runs uncaptured, so does the next step, and the forward returns clones from then on.
    emulators, ref, mod, compiled = _trained_lending(monkeypatch)
    kept, kept_ref = None, None
    for i in range(4):
        x = torch.randn(6, 8)
        out, out_ref = compiled(x), ref(x)
        if kept is not None:
            torch.testing.assert_close(kept, kept_ref, msg=lambda m: f"step {i}: last step's output changed: {m}")
        out.pow(2).mean().backward()
        out_ref.pow(2).mean().backward()
        _same_grads_then_none(ref, mod)
        kept, kept_ref = out, out_ref.detach()
    assert kept.data_ptr() not in emulators[0].output_ptrs, "still lent after it was found kept"
    stats = _stats(compiled)
    fw, bw = stats["graph 0 segment 0 forward"], stats["graph 0 segment 0 backward"]
    assert fw["uncaptured_runs"] == 1 and any("returned at the previous replay" in r for r in fw["uncaptured_reasons"])
    assert bw["uncaptured_runs"] == 2 and any("forward's returned outputs" in r for r in bw["uncaptured_reasons"]), bw
    assert "copied after every replay" in bw["note"], bw
    # Steps 2-3 of _train, then every step here but the second (the forward) and the first two
    # (the backward).
    assert (fw["replays"], bw["replays"]) == (2 + 3, 2 + 2), stats


def test_an_output_held_through_the_backward_keeps_its_values(monkeypatch):
    # The backward records into its forward's pool and reuses the memory of the forward's
    # returned outputs: one still held when the backward replays (metrics read after it) makes
    # that backward run uncaptured, and the forward returns clones from then on.
    _, ref, mod, compiled = _trained_lending(monkeypatch)
    for i in range(3):
        x = torch.randn(6, 8)
        out, out_ref = compiled(x), ref(x)
        out.sum().backward()
        out_ref.sum().backward()
        torch.testing.assert_close(out, out_ref, msg=lambda m: f"step {i}: the backward overwrote the output: {m}")
        _same_grads_then_none(ref, mod)
        del out
    bw = _stats(compiled)["graph 0 segment 0 backward"]
    assert bw["uncaptured_runs"] == 1 and any("forward's returned outputs" in r for r in bw["uncaptured_reasons"]), bw
    assert bw["replays"] == 2 + 2, bw
    assert "copied after every replay" in bw["note"], bw


@pytest.mark.parametrize("held", [True, False])
def test_an_output_held_when_its_recording_is_released_raises_instead_of_reading_freed_memory(monkeypatch, held):
    # A returned output lent after the backward reused its memory lives in the pool: when the
    # recording goes (model dropped, recompiled, the process group destroyed) the pool goes too,
    # and a tensor still on it is made to raise on access (tests/gpu/test_gpu_cudagraphs.py reads
    # one; the emulation notes the call).
    emulators, ref, mod, compiled = _trained_lending(monkeypatch)
    out = compiled(torch.randn(6, 8)).detach()
    assert out.data_ptr() in emulators[0].output_ptrs
    if not held:
        del out
    del compiled, mod
    torch._dynamo.reset()
    gc.collect()
    assert emulators[0].poisoned == ([recording.RELEASED] if held else []), emulators[0].poisoned


class LossAndOutput(nn.Module):
    """Returns its loss and a large output (6 x 65,536 floats, 1.5 MiB) that the loss's backward
    does not read (a cross-entropy's backward reads its logits: a model returning those and the
    loss returns them as copies, as it returns saved activations)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1 << 16)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.head(torch.tanh(self.a(x)))
        return out.mean(), out


def test_a_loss_kept_through_the_backward_and_past_the_step_is_copied_and_a_large_output_lent(monkeypatch):
    # HF Trainer's step: the loss comes out of the model's graph, the caller holds it through the
    # backward and keeps a detached copy of it; the other outputs are dropped before the backward.
    emulators = use_emulated_graphs(monkeypatch)
    torch.manual_seed(0)
    ref = LossAndOutput()
    mod = copy.deepcopy(ref)
    compiled = bucketwise.compile(mod, backend="inductor", cudagraphs=True)
    losses = []
    for i in range(5):
        x = torch.randn(6, 8)
        loss, out = compiled(x)
        loss_ref, out_ref = ref(x)
        torch.testing.assert_close(out, out_ref)
        if i >= 1:  # recorded
            assert out.data_ptr() in emulators[0].output_ptrs, f"step {i}: the output was copied"
            assert loss.data_ptr() not in emulators[0].output_ptrs, f"step {i}: the loss was lent"
        del out
        loss.backward()
        loss_ref.backward()
        losses.append((loss.detach(), loss_ref.detach()))
        _same_grads_then_none(ref, mod)
    for kept, expected in losses:
        torch.testing.assert_close(kept, expected)
    for stats in _stats(compiled).values():
        assert stats["uncaptured_runs"] == 0 and stats["replays"] == 4, stats


def test_accumulating_stolen_gradients_stops_lending(monkeypatch):
    # zero_grad(set_to_none=True), then micro-steps: the first one's gradient *is* the backward
    # graph's output memory, which shares a pool with the forward, so the next forward must not
    # replay over it; the backward then stops lending and both replay again once the user let
    # go of the gradients.
    emulators = use_emulated_graphs(monkeypatch)
    ref, mod, compiled = _pair()
    _train(ref, mod, compiled, 3)
    _train(ref, mod, compiled, 3, micro=3)
    stats = _stats(compiled)
    fw, bw = stats["graph 0 segment 0 forward"], stats["graph 0 segment 0 backward"]
    assert emulators[0].shared == 1, "the backward did not join its forward's pool"
    # The two micro-steps that found the first one's lent gradients held run uncaptured; every
    # step after that replays (2 in the warm-up steps, 1 + 3 + 3 here).
    assert fw["uncaptured_runs"] == 2 and any("gradients of its backward" in r for r in fw["uncaptured_reasons"]), fw
    assert bw["uncaptured_runs"] == 2 and any("forward ran uncaptured" in r for r in bw["uncaptured_reasons"]), bw
    assert fw["replays"] == bw["replays"] == 9, stats
    assert fw["records"] == bw["records"] == 1, stats


def test_warm_ups_allocate_from_a_pool_dropped_before_the_first_capture(monkeypatch):
    # What a warm-up frees must not stay cached where an optimizer's first step would pin it (on
    # a GPU), nor crowd the recording's pool: the warm-ups allocate from a pool of their own,
    # gone before the first capture; the forward's recording makes a pool, its backward joins
    # it, and both copy buffers come from it.
    emulators = use_emulated_graphs(monkeypatch)
    ref, mod, compiled = _pair()
    _train(ref, mod, compiled, 3)
    em = emulators[0]
    assert em.pools == 2 and em.shared == 1 and em.warm_pools_at_capture == 0, (em.pools, em.shared)
    pools = [p() for p in em.allocated_in]
    assert len(pools) == 4 and pools[0] is None and pools[1] is None, pools
    assert pools[2] is pools[3] and len(pools[2].graphs) == 2, pools
    # The recording's pool starts with one block of what the forward's warm-up returned: the bytes
    # its capture's outputs hold (NOTE [a forward and its backward share a pool]); warm-ups' none.
    held = {o.untyped_storage().data_ptr(): o.untyped_storage().nbytes() for o in pools[2].graphs[0].in_pool}
    assert em.reserved == [0, sum(held.values())] and em.reserved[1] > 0, (em.reserved, held)
    # Each pool is made right after the allocator's free memory (and cuBLAS's workspaces) went
    # back, so that its segments come on top of what is in use, not of what is cached.
    made = [i for i, call in enumerate(em.calls) if call == "pool"]
    assert len(made) == 2 and all(i > 0 and em.calls[i - 1] == "release" for i in made), em.calls


def test_backward_with_retain_graph_keeps_the_activations(monkeypatch):
    # The backward frees (and may overwrite) the activations it reads; retain_graph=True keeps
    # them for a second backward, so that backward runs uncaptured and the second one reads
    # intact activations. (torch refuses retain_graph=True for a backward that reuses its saved
    # activations as scratch, "donated buffers": off here.)
    use_emulated_graphs(monkeypatch)
    with torch._functorch.config.patch(donated_buffer=False):
        _retain_graph_keeps_the_activations()


def _retain_graph_keeps_the_activations():
    ref, mod, compiled = _pair()
    _train(ref, mod, compiled, 3)
    x = torch.randn(6, 8)
    out_r, out_c = ref(x).pow(2).mean(), compiled(x).pow(2).mean()
    out_r.backward(retain_graph=True)
    out_c.backward(retain_graph=True)
    (2 * out_r).backward()
    (2 * out_c).backward()
    for p, q in zip(ref.parameters(), mod.parameters()):
        torch.testing.assert_close(q.grad, p.grad)
    bw = _stats(compiled)["graph 0 segment 0 backward"]
    assert any("retain_graph" in r for r in bw["uncaptured_reasons"]), bw
    for p in mod.parameters():
        p.grad = None
    for p in ref.parameters():
        p.grad = None
    _train(ref, mod, compiled, 2)
    assert _stats(compiled)["graph 0 segment 0 backward"]["replays"] > bw["replays"]


def test_saved_tensor_hooks_that_move_activations_run_the_backward_uncaptured(monkeypatch):
    # Once recorded, the backward reads the saved activations where the forward's replay wrote
    # them. A pack hook that copies each one (as offloading does) hands it tensors elsewhere: it
    # runs uncaptured and says why, without recording again at the copies' addresses, and
    # replays again once the hook is gone. Recorded under the hook, it copies them instead.
    use_emulated_graphs(monkeypatch)
    ref, mod, compiled = _pair()
    _train(ref, mod, compiled, 3)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
        _train(ref, mod, compiled, 3)
    bw = _stats(compiled)["graph 0 segment 0 backward"]
    assert bw["uncaptured_runs"] == 3 and any("saved-tensor hooks" in r for r in bw["uncaptured_reasons"]), bw
    _train(ref, mod, compiled, 2)
    after = _stats(compiled)["graph 0 segment 0 backward"]
    assert after["records"] == 1 and after["replays"] == bw["replays"] + 2, after


def test_outputs_where_consumed_activations_lived_are_not_taken_for_inputs():
    # A backward in its forward's pool frees the activations it reads and may put a gradient at
    # the very address one of them had: that gradient is an output to protect and lend, not an
    # input handed back (which would be handed out as is and copied by AccumulateGrad).
    activation, param = torch.randn(4), nn.Parameter(torch.randn(3))
    plan = plan_inputs([activation, param], frozenset([1]), {activation.data_ptr()})
    assert activation.untyped_storage().data_ptr() in plan.input_ptrs
    plan.consumed = {0: 0}
    plan.hand_over()
    assert activation.untyped_storage().data_ptr() not in plan.input_ptrs
    assert param.untyped_storage().data_ptr() in plan.input_ptrs
    assert plan.keep == [None, param]


def test_new_shapes_rerecord_up_to_the_bound(monkeypatch):
    use_emulated_graphs(monkeypatch)
    ref, mod, compiled = _pair(dynamic=True)
    steps = 2 * (MAX_RECORDS + 2)
    _train(ref, mod, compiled, steps, batch=lambda i: 4 + i // 2)  # each size twice: warm-up, record
    fw = _stats(compiled)["graph 0 segment 0 forward"]
    assert fw["records"] == MAX_RECORDS and not fw["captured"], fw
    assert "recorded 8 times" in fw["reason"], fw


def test_failed_capture_runs_uncaptured_with_the_reason(monkeypatch):
    use_emulated_graphs(monkeypatch, fail_capture=True)
    ref, mod, compiled = _pair()
    _train(ref, mod, compiled, 4)
    fw = _stats(compiled)["graph 0 segment 0 forward"]
    assert not fw["captured"] and fw["replays"] == 0 and "capture failed" in fw["reason"], fw


def test_permuted_inputs_are_copied_and_expanded_ones_refused(monkeypatch):
    """A permuted input is dense: copied into a buffer of the same strides and replayed. An
    expanded one is not: that graph runs uncaptured and the stats say why (never an exception)."""
    use_emulated_graphs(monkeypatch)

    def f(x):
        return x.sin() * 2

    for make, replays in [(lambda: torch.randn(4, 6).t(), 3), (lambda: torch.randn(1, 6).expand(4, 6), 0)]:
        torch.compiler.reset()
        c = bucketwise.compile(f, backend="inductor", cudagraphs=True, dynamic=False)
        for _ in range(4):
            x = make()
            torch.testing.assert_close(c(x), x.sin() * 2)
        (stats,) = bucketwise.report(c).cudagraphs
        assert stats.replays == replays, stats
        if replays == 0:
            assert "is not dense" in stats.reason, stats


def test_writing_into_a_plain_input_runs_uncaptured(monkeypatch):
    use_emulated_graphs(monkeypatch)

    def f(x, counter):
        counter.add_(1)  # a plain tensor argument, not a parameter or buffer
        return x * 2

    c = bucketwise.compile(f, backend="inductor", cudagraphs=True)
    counter = torch.zeros(1)
    for _ in range(4):
        torch.testing.assert_close(c(torch.ones(3), counter), torch.full((3,), 2.0))
    assert counter.item() == 4
    (stats,) = bucketwise.report(c).cudagraphs
    assert stats.replays == 0 and "writes into input" in stats.reason, stats


def test_a_moved_parameter_rerecords(monkeypatch):
    use_emulated_graphs(monkeypatch)
    ref, mod, compiled = _pair()
    _train(ref, mod, compiled, 3)
    with torch.no_grad():  # new storage for a parameter (as load_state_dict(assign=True) does)
        mod.a.weight.data = mod.a.weight.data.clone()
    _train(ref, mod, compiled, 4)
    fw = _stats(compiled)["graph 0 segment 0 forward"]
    assert fw["records"] == 2 and fw["uncaptured_runs"] >= 1, fw


# --- DDP, 2 gloo ranks ---------------------------------------------------------------------


def _ddp_worker(rank: int, world_size: int, case: str, strategy: str) -> dict:
    use_emulated_graphs()
    bucketwise.compile = functools.partial(bucketwise.compile, cudagraphs=True)
    return train_and_compare(rank, world_size, case, strategy, "inductor")


@pytest.mark.parametrize("case,strategy", [("inductor_mlp", "split"), ("inductor_mlp", "fused"), ("no_sync", "fused")])
def test_ddp_with_cudagraphs_matches_eager_ddp(tmp_path, case, strategy):
    results = run_distributed(_ddp_worker, tmp_path, args=(case, strategy), timeout=500)
    for r in results:
        stats = r["report"]["cudagraphs"]
        assert stats, r["report"]
        replayed = [s for s in stats if s["replays"] > 0]
        assert any(s["name"].endswith("backward") for s in replayed), stats
        assert any(s["name"].endswith("forward") for s in replayed), stats
        # Parameters are read in place, in split segments too (AOTAutograd sees them as inputs).
        assert all(s["inputs_copied"] <= 3 for s in replayed), stats
        if strategy == "split":
            assert len({s["name"].rsplit(" ", 1)[0] for s in stats}) >= 2, stats  # one per segment
