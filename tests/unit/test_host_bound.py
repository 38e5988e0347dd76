"""The runtime view says when the host is the step (NOTE [saying when the host is the step]):
from the trace's kernels against the step's wall time, with advice that depends on whether the
compiled graphs already replay as CUDA graphs."""

from __future__ import annotations

import pytest

from bucketwise.stats.runtime_view import GPU_BOUND_BUSY, GPU_BOUND_PREFIX, HOST_BOUND_BUSY, RuntimeView, analyze


def _kernels(busy_us: float, steps: int, step_us: float) -> list[dict]:
    """Per step, back-to-back kernels of 10 us filling ``busy_us`` of a ``step_us`` step, plus a
    second stream's kernel inside the busy span (counted once: the union)."""
    events = []
    for s in range(steps):
        t0 = s * step_us
        n = int(busy_us // 10)
        events += [
            {"ph": "X", "cat": "kernel", "name": f"triton_{i}", "ts": t0 + 10 * i, "dur": 10, "args": {}}
            for i in range(n)
        ]
        events.append({"ph": "X", "cat": "kernel", "name": "copy", "ts": t0 + 5, "dur": 10, "args": {}})
    return events


REPORT = {"target": "DDP(Net)", "rank": 0, "world_size": 1, "graphs": []}


def test_idle_gpu_is_called_host_bound_with_the_cudagraphs_advice():
    view = analyze(_kernels(400, steps=3, step_us=1000), REPORT, steps=3, step_ms=1.0)
    assert view.gpu_busy_ms == pytest.approx(0.4)
    assert view.host_bound
    (note,) = [n for n in view.notes if n.startswith("host-bound")]
    assert "busy 0.40 of 1.00 ms per step (40%)" in note and "cudagraphs=True" in note
    assert "GPU busy 0.40 ms" in view.table()


def test_a_host_bound_step_calling_shared_blocks_says_what_they_cost():
    """NOTE [saying when the host is the step]: without CUDA graphs each shared block's call costs
    host time; the host-bound note names the blocks and both remedies, and says nothing of
    blocks where none are shared."""
    shared = {"blocks": "model.layers", "class": "LlamaDecoderLayer", "count": 16, "compiles": 1}
    report = {**REPORT, "graphs": [{"graph_id": 0, "shared_blocks": shared}]}
    view = analyze(_kernels(300, steps=2, step_us=1000), report, steps=2, step_ms=1.0)
    (note,) = [n for n in view.notes if n.startswith("host-bound")]
    assert "the 16 blocks of `model.layers` share one compile" in note, note
    assert "cudagraphs=True" in note and "share_blocks=False" in note, note
    plain = analyze(_kernels(300, steps=2, step_us=1000), REPORT, steps=2, step_ms=1.0)
    (note,) = [n for n in plain.notes if n.startswith("host-bound")]
    assert "share_blocks" not in note, note


def test_busy_gpu_is_not_host_bound():
    busy = 1000 * HOST_BOUND_BUSY + 50
    view = analyze(_kernels(busy, steps=2, step_us=1000), REPORT, steps=2, step_ms=1.0)
    assert not view.host_bound and not any(n.startswith("host-bound") for n in view.notes)


def test_graphs_already_replaying_get_other_advice():
    report = {**REPORT, "cudagraphs": [{"name": "g0 backward", "captured": True}]}
    view = analyze(_kernels(300, steps=1, step_us=1000), report, steps=1, step_ms=1.0)
    (note,) = [n for n in view.notes if n.startswith("host-bound")]
    assert "already replay as CUDA graphs" in note and "cudagraphs=True" not in note


def test_the_totals_give_cpu_time_and_cuda_memory_beside_the_step():
    """Memory and host time beside every step time (NOTE [a step's CPU time]): a host working
    the whole step shows a CPU time near the step's, and the caching allocator's figures follow;
    a view written before these fields reads back without them."""
    view = analyze(
        _kernels(400, steps=2, step_us=1000), REPORT, steps=2, step_ms=1.0, cpu_ms=0.97, memory_mib=(7551.2, 8020.0)
    )
    (line,) = [x for x in view.table().splitlines() if x.startswith("rank 0: 2 profiled step(s)")]
    assert "1.00 ms per step (CPU time 0.97 ms), GPU busy 0.40 ms" in line, line
    assert line.endswith("; CUDA memory: peak allocated 7,551 MiB so far, 8,020 MiB reserved"), line
    old = {k: v for k, v in view.to_dict().items() if k not in ("cpu_ms", "peak_allocated_mib", "reserved_mib")}
    again = RuntimeView.from_dict(old)
    assert again.cpu_ms is None and "CPU time" not in again.table() and "CUDA memory" not in again.table()


def test_cpu_trace_has_no_verdict_and_round_trips():
    view = analyze([], REPORT, steps=1, step_ms=1.0)
    assert view.gpu_busy_ms is None and not view.host_bound
    again = RuntimeView.from_dict(view.to_dict())
    assert again == view and view.to_dict()["host_bound"] is False


def _write_view(folder, rank: int, busy_us: float) -> None:
    import json

    view = analyze(_kernels(busy_us, steps=2, step_us=1000), {**REPORT, "rank": rank}, steps=2, step_ms=1.0)
    (folder / f"runtime-rank{rank}.json").write_text(json.dumps(view.to_dict()))


def test_doctor_names_the_host_bound_ranks(tmp_path):
    from bucketwise.launch import stats

    _write_view(tmp_path, 0, 300)
    _write_view(tmp_path, 1, 950)
    (line,) = stats.host_bound_lines(str(tmp_path), 2)
    assert (
        line.startswith("bucketwise doctor: rank 0: host-bound: the GPU was busy 0.30 of 1.00 ms")
        and "cudagraphs=True" in line
    )
    (tmp_path / "runtime-rank0.json").unlink()
    assert stats.host_bound_lines(str(tmp_path), 2) == [
        "bucketwise doctor: the GPU was busy 95% or more of every profiled step: not bound by the host"
    ]


@pytest.mark.parametrize("text", ["[1, 2]", '"a string"', "{}", "not json"])
def test_a_runtime_file_that_is_not_a_view_is_skipped_and_named(tmp_path, text):
    from bucketwise.launch import stats

    _write_view(tmp_path, 0, 300)
    (tmp_path / "runtime-rank1.json").write_text(text)
    warned = []
    views = stats.runtime_views(str(tmp_path), warned.append)
    assert [v.rank for v in views] == [0]
    (message,) = warned
    assert message.startswith(f"skipping {tmp_path / 'runtime-rank1.json'}: not a runtime view"), message


def test_doctor_says_nothing_without_views_and_why_on_cpu(tmp_path):
    import json

    from bucketwise.launch import stats

    (line,) = stats.host_bound_lines(str(tmp_path), 3)
    assert line.startswith("bucketwise doctor: no step was profiled: the job ended within its warm-up, before 3")
    (tmp_path / "runtime-rank0.json").write_text(json.dumps(analyze([], REPORT, steps=1, step_ms=1.0).to_dict()))
    assert stats.host_bound_lines(str(tmp_path), 3) == [
        "bucketwise doctor: no GPU kernels in the profiled steps: nothing to say about host-bound steps"
    ]


def _profiled_notes(compiled, out_dir, monkeypatch, *, busy_us: float) -> list[str]:
    """The report's notes after ``bucketwise.profile`` around two steps of ``compiled`` (a model
    of 8 inputs), the trace analysed as one whose GPU was busy ``busy_us`` of every 1 ms step (a
    CPU trace has no kernels)."""
    import torch

    import bucketwise
    from bucketwise.stats import profiling

    real = profiling.analyze
    monkeypatch.setattr(
        profiling,
        "analyze",
        lambda events, report, **kw: real(
            _kernels(busy_us, steps=kw["steps"], step_us=1000), report, **{**kw, "step_ms": 1.0}
        ),
    )
    with bucketwise.profile(compiled, out_dir=out_dir, plot=False):
        for _ in range(2):
            compiled(torch.randn(4, 8)).sum().backward()
    return bucketwise.report(compiled).notes


def test_profile_puts_the_host_bound_note_in_the_report(single_rank_group, tmp_path, monkeypatch):
    """A host-bound verdict of ``bucketwise.profile`` (GPU busy 30%) reaches the report (table,
    rank file)."""
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bucketwise

    compiled = bucketwise.compile(DDP(nn.Linear(8, 8)), backend="aot_eager", strategy="fused")
    notes = _profiled_notes(compiled, tmp_path, monkeypatch, busy_us=300)
    (note,) = [n for n in notes if "host-bound" in n]
    assert note.startswith("profiled steps: host-bound: the GPU was busy 0.30 of 1.00 ms") and "cudagraphs=True" in note
    assert note in bucketwise.report(compiled).table()


# NOTE [saying when sharing blocks is free]: a GPU-bound profile with blocks left unshared for
# host time only gets the advice to try share_blocks=True; nothing else does.

UNSHARED = {"container": "model.layers", "blocks": 32, "reason": "share_blocks='auto' ...", "host_time": True}


def _gpu_bound(report: dict, busy_us: float = 980) -> list[str]:
    view = analyze(_kernels(busy_us, steps=2, step_us=1000), report, steps=2, step_ms=1.0)
    return [n for n in view.notes if n.startswith(GPU_BOUND_PREFIX)]


def test_gpu_bound_steps_with_blocks_unshared_for_host_time_get_the_sharing_advice():
    (note,) = _gpu_bound({**REPORT, "graphs": [{"strategy": "fused"}], "unshared_blocks": [UNSHARED]})
    assert "busy 0.98 of 1.00 ms per step (98%)" in note, note
    assert "the 32 blocks of `model.layers` compiled with the whole graph" in note and "share_blocks=True" in note


@pytest.mark.parametrize(
    "case",
    ["busy under the mark", "no unshared blocks", "unshared for another reason", "split"],
)
def test_no_sharing_advice_where_it_does_not_apply(case):
    report = {**REPORT, "graphs": [{"strategy": "fused"}], "unshared_blocks": [UNSHARED]}
    busy = 980.0
    if case == "busy under the mark":
        busy = 1000 * GPU_BOUND_BUSY - 30
    elif case == "no unshared blocks":
        report["unshared_blocks"] = []
    elif case == "unshared for another reason":
        report["unshared_blocks"] = [{**UNSHARED, "host_time": False}]
    else:
        report["graphs"] = [{"strategy": "split"}]
    assert _gpu_bound(report, busy) == []


def test_doctor_adds_the_sharing_advice_after_its_verdict(tmp_path):
    import json

    from bucketwise.launch import stats

    report = {**REPORT, "graphs": [{"strategy": "fused"}], "unshared_blocks": [UNSHARED]}
    view = analyze(_kernels(980, steps=2, step_us=1000), report, steps=2, step_ms=1.0)
    (tmp_path / "runtime-rank0.json").write_text(json.dumps(view.to_dict()))
    verdict, advice = stats.host_bound_lines(str(tmp_path), 2)
    assert verdict.endswith("not bound by the host"), verdict
    assert advice.startswith("bucketwise doctor: rank 0: GPU-bound: the GPU was busy 0.98 of 1.00 ms"), advice


def test_profile_of_a_gpu_bound_step_advises_sharing_the_blocks_auto_left(single_rank_group, tmp_path, monkeypatch):
    """``share_blocks="auto"`` without CUDA graphs compiles a DDP model's three blocks with the
    whole graph; a profile whose GPU was busy 98% puts the advice to share them in the report."""
    from support.small_net import BlocksNet
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bucketwise

    compiled = bucketwise.compile(DDP(BlocksNet()), backend="aot_eager")
    notes = _profiled_notes(compiled, tmp_path, monkeypatch, busy_us=980)
    (note,) = [n for n in notes if "GPU-bound" in n]
    assert note.startswith("profiled steps: GPU-bound: the GPU was busy 0.98 of 1.00 ms"), note
    assert "the 3 blocks of `blocks` compiled with the whole graph" in note and "share_blocks=True" in note
