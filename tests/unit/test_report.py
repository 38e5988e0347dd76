"""bucketwise.report(): serialisation, the text table, per-rank stats files, compile fallbacks,
and leaving torch's own DDPOptimizer alone.

A one-rank gloo group in this process gives DDP a real reducer (bucket rebuild, alignment)
without spawning; numerics are compared against eager DDP on the same group.
"""

from __future__ import annotations

import copy
import json
import os
import time

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import bucketwise
from bucketwise.stats.report_data import ReportData
from bucketwise.stats.report_format import format_table


class MLP(nn.Module):
    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(depth))  # 16 KiB weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class BreakNet(nn.Module):
    """Two graphs (an explicit graph break in the middle)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = MLP(2)
        self.b = MLP(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        torch._dynamo.graph_break()
        return self.b(x)


class ReluNet(nn.Module):
    """torch.relu only in the first layer's segment (what relu_compile_error_TESTING_ONLY
    refuses); the other segments have none."""

    def __init__(self) -> None:
        super().__init__()
        self.l0 = nn.Linear(64, 64)
        self.l1 = nn.Linear(64, 64)
        self.l2 = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.l0(x))
        x = torch.tanh(self.l1(x))
        return self.l2(x)


CAP_MB = 0.01  # 10 KiB: every 16 KiB layer is a bucket of its own


def _train(compiled, ref, steps: int, *, batch: int = 8, check: bool = True) -> None:
    """Train both with SGD on the same data; compare losses, grads and params each step."""
    opt_c = torch.optim.SGD(compiled.parameters(), lr=0.1)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(steps):
        x = torch.randn(batch, 64, generator=torch.Generator().manual_seed(step))
        loss_c = compiled(x).square().mean()
        loss_r = ref(x).square().mean()
        loss_c.backward()
        loss_r.backward()
        if check:
            torch.testing.assert_close(loss_c, loss_r, rtol=1e-5, atol=1e-6)
            for (n, p), (_, q) in zip(compiled.named_parameters(), ref.named_parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"grad {n}: {m}")
        opt_c.step()
        opt_r.step()
        opt_c.zero_grad()
        opt_r.zero_grad()
    if check:
        for (n, p), (_, q) in zip(compiled.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"param {n}: {m}")


def _pair(module: nn.Module, **compile_kwargs):
    """(bucketwise-compiled DDP, eager DDP) over two copies of ``module``."""
    ref = DDP(copy.deepcopy(module), bucket_cap_mb=CAP_MB)
    compiled = bucketwise.compile(
        DDP(copy.deepcopy(module), bucket_cap_mb=CAP_MB),
        **{"backend": "aot_eager", "strategy": "split", **compile_kwargs},
    )
    return compiled, ref


# --- to_dict / to_json / table ---------------------------------------------------------------


def test_to_dict_and_json_round_trip(single_rank_group, tmp_path):
    compiled, ref = _pair(MLP())
    rep = bucketwise.report(compiled)
    assert rep.totals["graphs"] == 0 and rep.alignment is None
    _train(compiled, ref, 1)
    # One iteration: the reducer has not rebuilt its buckets yet.
    assert rep.alignment is None
    assert "pending" in rep.alignment_detail()["status"]
    assert "alignment n/a" in rep.table()
    _train(compiled, ref, 4)
    d = rep.to_dict()
    assert d["schema"] == 1
    assert d["target"] == "DDP(MLP)" and d["strategy"] == "split" and d["backend"] == "aot_eager"
    assert (d["rank"], d["world_size"]) == (0, 1)
    assert d["totals"]["graphs"] == len(d["graphs"]) == 1
    assert d["totals"]["segments"] == sum(len(g["segments"]) for g in d["graphs"]) == 4
    assert d["totals"]["alignment"] == d["alignment"]["alignment"] == rep.alignment == 1.0
    seg_params = [p for g in d["graphs"] for s in g["segments"] for p in s["params"]]
    assert sorted(seg_params) == sorted(n for n, _ in compiled.module.named_parameters())
    for g in d["graphs"]:
        for s in g["segments"]:
            assert s["param_count"] == len(s["params"])
            assert s["bytes"] == sum(compiled.module.get_parameter(p).nbytes for p in s["params"])
            assert s["backend"] == "aot_eager" and not s["fell_back"]
    # JSON: serialisable as is, and to_json writes exactly to_dict().
    assert json.loads(json.dumps(d)) == d
    out = tmp_path / "out"
    out.mkdir()
    path = out / "report.json"
    rep.to_json(path)
    assert json.loads(path.read_text()) == json.loads(json.dumps(rep.to_dict()))
    rep.to_json(str(path))  # str paths too; overwrites
    assert json.loads(path.read_text())["totals"]["segments"] == 4
    assert sorted(os.listdir(out)) == ["report.json"], "no temporary files left behind"
    assert "alignment=1.0" in repr(rep)


class UnusedLayerMLP(MLP):
    """An MLP with one layer the forward never calls (DDP: ``find_unused_parameters=True``)."""

    def __init__(self) -> None:
        super().__init__(2)
        self.unused = nn.Linear(64, 64)


def test_unused_parameters_do_not_split_a_bucket(single_rank_group):
    """A healthy split run whose model has a parameter no step uses: its bucket is aligned (the
    reducer marks an unused gradient ready at once, it waits for no eager code)."""
    module = UnusedLayerMLP()
    ref = DDP(copy.deepcopy(module), find_unused_parameters=True)
    compiled = bucketwise.compile(
        DDP(copy.deepcopy(module), find_unused_parameters=True), backend="aot_eager", strategy="split"
    )
    _train(compiled, ref, 3)
    rep = bucketwise.report(compiled)
    detail = rep.alignment_detail()
    assert rep.alignment == 1.0, detail
    (bucket,) = detail["buckets"]  # one bucket: default caps
    assert bucket["status"] == "aligned; not read by any graph: unused.weight, unused.bias", bucket
    assert "alignment 1.00" in rep.table()


def test_plain_module_counts_its_parameters(tmp_path):
    """A module compiled without DDP: the table counts the parameters each graph reads."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    compiled = bucketwise.compile(model, backend="aot_eager")
    compiled(torch.randn(3, 4)).sum().backward()
    (graph,) = bucketwise.report(compiled).to_dict()["graphs"]
    (segment,) = graph["segments"]
    assert sorted(segment["params"]) == ["0.bias", "0.weight", "2.bias", "2.weight"], segment
    assert segment["bytes"] == sum(p.nbytes for p in model.parameters())


def test_report_data_reads_back_what_the_report_wrote(single_rank_group, tmp_path):
    compiled, ref = _pair(MLP())
    _train(compiled, ref, 5)
    rep = bucketwise.report(compiled)
    path = tmp_path / "report.json"
    rep.to_json(path)
    data = ReportData.from_dict(json.loads(path.read_text()))
    assert data.to_dict() == json.loads(path.read_text())
    assert (data.rank, data.world_size, data.target, data.strategy) == (0, 1, "DDP(MLP)", "split")
    assert data.totals["segments"] == sum(len(g.segments) for g in data.graphs) == 4
    live = rep.to_dict()["graphs"]
    assert [g.graph_id for g in data.graphs] == [g["graph_id"] for g in live]
    assert [s.params for g in data.graphs for s in g.segments] == [
        tuple(s["params"]) for g in live for s in g["segments"]
    ]
    assert rep.table() == format_table(data)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.pop("graphs"), "missing graphs"),
        (lambda d: d.update(rank="0"), "'rank' and 'world_size' must be integers"),
        (lambda d: d["totals"].pop("fallbacks"), "'totals' must hold graphs, graph_breaks"),
        (lambda d: d.update(schema=2), "report schema 2; this bucketwise reads schema 1"),
        (lambda d: d["graphs"][0]["segments"][0].pop("bytes"), "malformed segment in graph 0"),
    ],
)
def test_report_data_names_what_is_wrong(single_rank_group, change, message):
    compiled, ref = _pair(MLP())
    _train(compiled, ref, 1)
    d = copy.deepcopy(bucketwise.report(compiled).to_dict())
    change(d)
    with pytest.raises(ValueError, match=message):
        ReportData.from_dict(d)


def test_table_has_a_row_per_segment(single_rank_group):
    compiled, ref = _pair(BreakNet())
    _train(compiled, ref, 4)
    rep = bucketwise.report(compiled)
    d = rep.to_dict()
    assert d["totals"]["graphs"] == 2
    rows_expected = [(g["graph_id"], s["index"]) for g in d["graphs"] for s in g["segments"]]
    assert len(rows_expected) == d["totals"]["segments"] == 5
    lines = rep.table().splitlines()
    assert lines[0].split()[:3] == ["graph", "seg", "params"]
    rows = [ln.split() for ln in lines[1 : 1 + len(rows_expected)]]
    assert [(int(r[0]), int(r[1])) for r in rows] == rows_expected
    for r, (gid, idx) in zip(rows, rows_expected):
        seg = d["graphs"][gid]["segments"][idx]
        assert int(r[2]) == seg["param_count"]
        assert r[6] == "aot_eager" and r[7] == "-"
    # Then the totals line; nothing else looks like a segment row.
    assert lines[1 + len(rows_expected)].startswith("graphs 2, ")
    assert "segments 5" in lines[1 + len(rows_expected)]
    assert "graph break" in rep.table()


# --- $BUCKETWISE_STATS_DIR ---------------------------------------------------------------------


def test_stats_dir_rank_file(single_rank_group, tmp_path, monkeypatch):
    stats = tmp_path / "stats"
    monkeypatch.setenv("BUCKETWISE_STATS_DIR", str(stats))
    compiled, ref = _pair(MLP())
    assert not stats.exists() or not os.listdir(stats), "nothing written before a graph compiles"
    _train(compiled, ref, 1)
    assert sorted(os.listdir(stats)) == ["rank0.json"], os.listdir(stats)
    data = json.loads((stats / "rank0.json").read_text())
    assert data["rank"] == 0 and data["totals"]["graphs"] == 1 and data["totals"]["segments"] == 4
    assert data["totals"]["alignment"] is None
    # Once the reducer's buckets are known, the file is refreshed with the alignment.
    _train(compiled, ref, 4)
    data = json.loads((stats / "rank0.json").read_text())
    assert data["totals"]["alignment"] == 1.0, data["alignment"]
    # Written whole then renamed: no temporary file is left next to it.
    assert sorted(os.listdir(stats)) == ["rank0.json"], os.listdir(stats)

    # A second compiled object of this process does not overwrite the first one's file.
    second, ref2 = _pair(MLP(depth=2))
    _train(second, ref2, 1)
    assert json.loads((stats / "rank0.json").read_text())["totals"]["segments"] == 4
    other = [p for p in stats.rglob("rank0.json") if p != stats / "rank0.json"]
    assert len(other) == 1, sorted(map(str, stats.rglob("*")))
    assert json.loads(other[0].read_text())["totals"]["segments"] == 2
    leftovers = [p.name for p in stats.rglob("*") if p.is_file() and p.name != "rank0.json"]
    assert not leftovers, leftovers


# --- compile failures ----------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["split", "none"])
def test_failing_backend_falls_back_to_eager(single_rank_group, strategy):
    compiled, ref = _pair(ReluNet(), backend="relu_compile_error_TESTING_ONLY", strategy=strategy, fallback="eager")
    _train(compiled, ref, 4)  # correct numerics, eagerly where the compile failed
    d = bucketwise.report(compiled).to_dict()
    segs = [s for g in d["graphs"] for s in g["segments"]]
    failed = [s for s in segs if s["fell_back"]]
    assert d["totals"]["fallbacks"] == len(failed) == 1, segs
    assert failed[0]["backend"] == "eager"
    assert "ReluCompileError" in failed[0]["reason"]
    assert "l0.weight" in failed[0]["params"]
    if strategy == "split":
        # Only the segment holding torch.relu fails; the others compile.
        assert len(segs) == 3
        assert [s["fell_back"] for s in segs] == [True, False, False]
        assert [s["backend"] for s in segs[1:]] == ["relu_compile_error_TESTING_ONLY"] * 2
    assert "ReluCompileError" in bucketwise.report(compiled).table()


def _exploding_backend(gm, example_inputs):
    raise RuntimeError("boom: this backend cannot compile anything")


def test_callable_backend_raising_falls_back(single_rank_group):
    compiled, ref = _pair(MLP(), backend=_exploding_backend, fallback="eager")
    _train(compiled, ref, 3)
    d = bucketwise.report(compiled).to_dict()
    assert d["backend"] == "_exploding_backend"
    segs = [s for g in d["graphs"] for s in g["segments"]]
    assert len(segs) == 4 and all(s["fell_back"] for s in segs)
    assert all(s["reason"].startswith("RuntimeError: boom") for s in segs)
    assert d["totals"]["fallbacks"] == 4


@pytest.mark.parametrize("strategy", ["split", "none"])
def test_failing_backend_with_fallback_raise(single_rank_group, strategy):
    compiled, _ = _pair(ReluNet(), backend="relu_compile_error_TESTING_ONLY", strategy=strategy, fallback="raise")
    with pytest.raises(Exception) as info:
        compiled(torch.randn(4, 64))
    chain, exc = [], info.value
    while exc is not None:
        chain.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
    assert any("ReluCompileError" in c for c in chain), chain
    assert bucketwise.report(compiled).totals["fallbacks"] == 0


# --- torch's own DDPOptimizer is left alone -----------------------------------------------------


class Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(512, 512) for _ in range(4))  # 1 MiB each

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _plain_torch_compile_graph_count() -> int:
    """Graphs torch.compile(DDP(model)) hands the backend: torch's DDPOptimizer splits one
    Dynamo graph into one subgraph per 1 MiB bucket."""
    calls = []

    def counting_backend(gm, example_inputs):
        calls.append(gm)
        return gm.forward

    torch._dynamo.reset()
    ddp = DDP(Wide(), bucket_cap_mb=1)
    compiled = torch.compile(ddp, backend=counting_backend)
    compiled(torch.randn(2, 512)).sum().backward()
    return len(calls)


def test_plain_torch_compile_keeps_ddp_optimizer(single_rank_group):
    assert torch._dynamo.config.optimize_ddp  # torch's default
    baseline = _plain_torch_compile_graph_count()
    assert baseline >= 3, "torch's DDPOptimizer should split the graph at 1 MiB buckets"
    flag = torch._dynamo.config.optimize_ddp

    # A bucketwise-compiled DDP module, trained a few steps.
    compiled, ref = _pair(MLP())
    _train(compiled, ref, 3)
    assert torch._dynamo.config.optimize_ddp == flag

    # A bucketwise-compiled function calling a DDP module (optimize_ddp is patched per call).
    ddp = DDP(MLP(), bucket_cap_mb=CAP_MB)
    fn = bucketwise.compile(lambda x: ddp(x).square().mean(), backend="aot_eager", strategy="split")
    for _ in range(2):
        fn(torch.randn(4, 64)).backward()
    assert torch._dynamo.config.optimize_ddp == flag
    assert bucketwise.report(fn).totals["segments"] >= 2
    with pytest.raises(RuntimeError):
        fn(torch.randn(4, 63))  # a failing call restores the flag too
    assert torch._dynamo.config.optimize_ddp == flag

    # The user's own torch.compile still goes through torch's DDPOptimizer.
    assert _plain_torch_compile_graph_count() == baseline


def test_recompile_names_the_failed_guard():
    import bucketwise

    def scale(x, n):
        return x * n

    compiled = bucketwise.compile(scale, backend="aot_eager")
    torch.testing.assert_close(compiled(torch.ones(3), 2), torch.full((3,), 2.0))
    torch.testing.assert_close(compiled(torch.ones(3), 3), torch.full((3,), 3.0))
    rep = bucketwise.report(compiled)
    assert rep.totals["recompiles"] == 1, rep.table()
    first, second = rep.graphs
    assert not first.recompile and first.recompile_reason is None
    assert second.recompile and "n == 2" in second.recompile_reason, second.recompile_reason
    assert "recompile, guard failed" in rep.table()


@pytest.mark.parametrize("on_recompile", ["raise", "eager"])
def test_freeze_stops_compiling(on_recompile):
    import bucketwise

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    compiled = bucketwise.compile(model, backend="aot_eager", dynamic=False)
    compiled(torch.randn(3, 4))
    bucketwise.freeze(compiled, on_recompile=on_recompile)
    x = torch.randn(5, 4)  # a new static shape: a guard fails
    if on_recompile == "raise":
        with pytest.raises(RuntimeError, match="size mismatch at index 0. expected 3, actual 5"):
            compiled(x)
    else:
        torch.testing.assert_close(compiled(x), model(x))
    assert bucketwise.report(compiled).totals["graphs"] == 1  # nothing new was compiled
    # Other compiled code in the process still compiles.
    other = torch.compile(lambda t: t * 2, backend="eager")
    other(torch.ones(2)), other(torch.ones(3))


def test_freeze_rejects_bad_arguments():
    import bucketwise

    with pytest.raises(ValueError, match="on_recompile"):
        bucketwise.freeze(bucketwise.compile(nn.Linear(2, 2), backend="eager"), on_recompile="ignore")
    with pytest.raises(TypeError, match="bucketwise.compile"):
        bucketwise.freeze(nn.Linear(2, 2))


@pytest.mark.parametrize("setting", ["1", "0"])
def test_progress_lines(monkeypatch, capsys, setting):
    import bucketwise

    monkeypatch.setenv("BUCKETWISE_PROGRESS", setting)
    compiled = bucketwise.compile(nn.Linear(4, 2), backend="aot_eager")
    compiled(torch.randn(3, 4))
    err = capsys.readouterr().err
    line = "[bucketwise] graph 0: whole graph, aot_eager, "
    if setting == "1":
        assert line in err and err.rstrip().endswith(" s"), err
    else:
        assert "[bucketwise]" not in err, err


# --- compile-time breakdown (NOTE [compile-time breakdown]) -------------------------------------


def test_compile_times_in_the_rank_file(single_rank_group, tmp_path, monkeypatch):
    """Dynamo's part and the lazily compiled backwards reach the stats file on the calls after a
    compile; the split graph's four segments each compile a backward."""
    stats = tmp_path / "stats"
    monkeypatch.setenv("BUCKETWISE_STATS_DIR", str(stats))
    compiled, ref = _pair(MLP())
    _train(compiled, ref, 1)
    first = json.loads((stats / "rank0.json").read_text())["graphs"][0]["compile_times"]
    # Rewritten after the first forward (Dynamo's record of the frame), before the backward ran.
    assert first["dynamo_s"] > 0 and first["backward_compiles"] == 0
    _train(compiled, ref, 2)
    t = json.loads((stats / "rank0.json").read_text())["graphs"][0]["compile_times"]
    assert t["dynamo_s"] > 0 and t["backward_compiles"] == 4
    assert t["aot_autograd_s"] > 0 and t["bucketwise_s"] > 0 and t["rank_check_s"] == 0
    assert t["fx_graph_cache"] == {"hit": 0, "miss": 0, "bypass": 0}, "aot_eager: no Inductor"
    assert t["total_s"] == pytest.approx(
        t["dynamo_s"] + t["bucketwise_s"] + t["aot_autograd_s"] + t["backend_s"], abs=1e-5
    )
    assert bucketwise.report(compiled).totals["compile_times"]["backward_compiles"] == 4
    from bucketwise.launch import stats as launch_stats

    merged = launch_stats.merge([launch_stats.load_rank_file(str(stats / "rank0.json"))])
    assert merged["compile_times"][0]["slowest"]["backward_compiles"] == 4
    # The run's compile seconds are every phase's, as in the breakdown table (not the segments'
    # forward compiles alone).
    total = merged["totals"]["0"]["compile_times"]["total_s"]
    assert f"compile {total:.2f}..{total:.2f} s per rank" in launch_stats.totals_line(merged)
    assert total > merged["totals"]["0"]["compile_seconds"]
    assert (
        "FX cache h/m/b" in launch_stats.format_merged(merged)
        and "FX cache h/m/b" in bucketwise.report(compiled).table()
    )


def test_compile_times_skip_runtime_records():
    """torch 2.11 also files records of runtime work (Triton autotuning at the first forward
    and backward) under a frame's compile id, without compile seconds: they are neither a
    second frame nor a backward compile, and the lazy backward between them is still claimed."""
    from bucketwise._compat import compile_records as cr
    from bucketwise.stats.compile_times import CompileTimes, CompileTimesTracker, _Tracked

    def rec(forward, start, frame_s=None, backward_s=None, inductor_s=None):
        return cr.CompileRecord(
            compile_id="0/0",
            forward=forward,
            start_us=start,
            end_us=start + 10,
            frame_s=frame_s,
            backend_s=None if frame_s is None else frame_s / 2,
            backward_s=backward_s,
            inductor_s=inductor_s,
            fx_hit=0,
            fx_miss=1,
        )

    records = [
        rec(True, 0, frame_s=20.0),
        rec(True, 30),
        rec(False, 40, backward_s=12.0, inductor_s=11.0),
        rec(False, 60),
    ]
    t = _Tracked(CompileTimes(aot_autograd_s=1.0, backend_s=2.0), "0/0", call_us=5)
    assert CompileTimesTracker._claim(t, records)
    assert t.times.dynamo_s == pytest.approx(10.0)
    assert t.times.backward_compiles == 1
    assert t.times.backend_s == pytest.approx(13.0) and t.times.aot_autograd_s == pytest.approx(2.0)
    assert not CompileTimesTracker._claim(t, records)  # each record once


def test_first_step_breakdown(single_rank_group):
    """NOTE [first step]: the first call and its backward are timed; their compile seconds are
    the graphs' breakdown, the rest is named (autotuning, other first-call work)."""
    compiled = bucketwise.compile(DDP(MLP(), bucket_cap_mb=CAP_MB), backend="aot_eager", strategy="fused")
    rep = bucketwise.report(compiled)
    assert rep.totals["first_step"] is None  # nothing ran yet
    x = torch.randn(8, 64)
    start = time.perf_counter()
    out = compiled(x)
    assert rep.totals["first_step"]["backward_s"] is None  # the backward has not run
    out.square().mean().backward()
    wall = time.perf_counter() - start
    first = rep.totals["first_step"]
    compile_total = rep.totals["compile_times"]["total_s"]
    assert first["backward_s"] > 0 and first["forward_s"] > 0
    assert first["compiled_calls_s"] == pytest.approx(first["forward_s"] + first["backward_s"], abs=1e-5)
    assert first["compile_s"] == pytest.approx(compile_total, abs=1e-5) and compile_total > 0
    assert first["compiled_calls_s"] == pytest.approx(
        first["compile_s"] + first["autotune_s"] + first["other_s"], abs=1e-5
    )
    assert first["compiled_calls_s"] <= wall
    table = rep.table()
    line = next(x for x in table.splitlines() if x.startswith("first step: compiled calls"))
    if not torch.cuda.is_available():
        # What a first call does besides compiling, on this machine's device.
        assert "CUDA" not in line and "NCCL" not in line and "CPU" in line, line
    # The table's total is the phases' total, the first step's compile part; the segments' own
    # column is their compile at the first forward, named so.
    assert f"compile {compile_total:.2f} s (every phase: the table below)" in table, table
    assert "fwd compile s" in table.splitlines()[0], table
    compiled(x).square().mean().backward()  # later steps are not timed
    assert rep.totals["first_step"]["forward_s"] == first["forward_s"]


def test_first_step_is_the_first_call_that_runs(single_rank_group):
    """A first call that raises (a bad input, a strategy refused at it) times nothing: the
    next call is the first step."""
    compiled = bucketwise.compile(DDP(MLP(), bucket_cap_mb=CAP_MB), backend="aot_eager", strategy="fused")
    with pytest.raises(RuntimeError):
        compiled(torch.randn(8, 63))  # the wrong width
    assert bucketwise.report(compiled).totals["first_step"] is None
    compiled(torch.randn(8, 64)).square().mean().backward()
    first = bucketwise.report(compiled).totals["first_step"]
    assert first is not None and first["backward_s"] is not None, first


@pytest.mark.inductor
def test_compile_times_show_the_caches_of_a_restart(single_rank_group, tmp_path, monkeypatch):
    """A restart within one process: compile, ``torch._dynamo.reset()``, compile again over the
    same cache dir. The first compile misses the FX graph cache (forward, backward) and the
    AOTAutograd cache; the second loads the fused graph from the AOTAutograd cache (bucket_sync
    and the comm scheduler pass carry stable keys, NOTE [compile cache keys]) and compiles no
    backward. The phases add up to no more than the wall time of the step."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    model, x = MLP(2), torch.randn(8, 64)
    runs = []
    with torch._inductor.config.patch(fx_graph_cache=True), torch._functorch.config.patch(enable_autograd_cache=True):
        for _ in range(2):
            torch._dynamo.reset()
            compiled = bucketwise.compile(DDP(copy.deepcopy(model), bucket_cap_mb=CAP_MB), strategy="fused")
            start = time.perf_counter()
            compiled(x).square().mean().backward()
            wall = time.perf_counter() - start
            compiled(x)  # the call after a compile reads torch's records of it
            runs.append((wall, bucketwise.report(compiled).to_dict()["graphs"][0]["compile_times"]))
    (cold_wall, cold), (warm_wall, warm) = runs
    assert cold["fx_graph_cache"] == {"hit": 0, "miss": 2, "bypass": 0}
    assert cold["aot_autograd_cache"] == {"hit": 0, "miss": 1, "bypass": 0}
    assert cold["backward_compiles"] == 1
    assert warm["aot_autograd_cache"] == {"hit": 1, "miss": 0, "bypass": 0}
    assert warm["fx_graph_cache"] == {"hit": 2, "miss": 0, "bypass": 0}
    assert warm["backward_compiles"] == 0
    for wall, t in runs:
        parts = [t["dynamo_s"], t["bucketwise_s"], t["aot_autograd_s"], t["backend_s"]]
        assert all(p is not None and p >= 0 for p in parts), t
        assert t["dynamo_s"] > 0 and t["aot_autograd_s"] > 0
        assert sum(parts) == pytest.approx(t["total_s"], abs=1e-5)
        assert t["total_s"] <= wall, (t, wall)
    assert cold["backend_s"] > 0 and warm["backend_s"] == 0, "a cache hit runs no Inductor compile"


def test_why_blocks_stay_whole_is_said_once_for_every_graph_it_holds_for():
    from types import SimpleNamespace

    from bucketwise.stats.report_format import shared_block_lines

    graphs = [
        SimpleNamespace(label="0", shared_blocks={"reason": "why"}),
        SimpleNamespace(label="1 (no_sync)", shared_blocks={"reason": "why"}),
        SimpleNamespace(label="2", shared_blocks={"reason": "dynamic shapes"}),
        SimpleNamespace(label="3", shared_blocks=None),
    ]
    assert shared_block_lines(graphs) == [
        "graphs 0, 1 (no_sync): blocks compiled with the whole graph: why",
        "graph 2: blocks compiled with the whole graph: dynamic shapes",
    ]
    # A note that gives the reason already says it: the table does not repeat it.
    said = ["blocks: 3 blocks compiled with the whole graph: why"]
    assert shared_block_lines(graphs, said=said) == ["graph 2: blocks compiled with the whole graph: dynamic shapes"]
