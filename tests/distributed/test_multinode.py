"""A job of several nodes prints one table, and the per-bucket runtime view.

- Two ``bucketwise launch`` agents on this host (c10d rendezvous, one rank each, each with its own
  stats folder) stand for two nodes: the agent of rank 0's node prints the table of both ranks,
  gathered through the job's store (NOTE [job-wide stats]), with the runtime view that
  ``--profile-steps`` asked for; the other agent says where that table is.
- ``bucketwise.profile`` on 2 gloo ranks: every planned bucket (all-reduces compressed to fp16,
  an embedding table looked up twice, gathered as rows) is found in every step of the trace,
  sending exactly the bytes the report plans.
- The trace analysis on hand-made CUDA and CPU traces (NOTE [collectives to buckets]).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from support.dist import run_distributed
from torch.nn.parallel import DistributedDataParallel as DDP

import bucketwise
from bucketwise.stats import trace_analysis as ta
from bucketwise.stats.runtime_view import RuntimeView, analyze

JOB_TIMEOUT = 300
VOCAB, DIM = 64, 16


class Lookups(nn.Module):
    """A token table read twice (gathered as rows under fused) and two layers (all-reduced)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.mix = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + 0.5 * self.tok((ids + 1) % VOCAB)
        return F.cross_entropy(self.head(torch.tanh(self.mix(x))).flatten(0, 1), ids.flatten())


# -- two agents, one table -------------------------------------------------------------------

TRAIN_SCRIPT = """
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import bucketwise
from bucketwise.launch.models import mlp

dist.init_process_group("gloo")
torch.manual_seed(0)
compiled = bucketwise.compile(DDP(mlp(width=32, depth=3), bucket_cap_mb=0.005), backend="aot_eager", strategy="fused")
opt = torch.optim.SGD(compiled.parameters(), lr=0.1)
for step in range(6):
    torch.manual_seed(step + 10 * dist.get_rank())
    compiled(torch.randn(8, 32)).square().mean().backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _agent(stats_dir, port: int, cwd) -> subprocess.Popen:
    env = dict(os.environ, BUCKETWISE_PROGRESS="0", OMP_NUM_THREADS="1")
    env.pop("BUCKETWISE_STATS_DIR", None)
    cmd = [
        sys.executable,
        "-m",
        "bucketwise.launch.cli",
        "launch",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"localhost:{port}",
        "--profile-steps",
        "3",
        "--stats-dir",
        str(stats_dir),
        "train.py",
    ]
    return subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def _finish(procs: list[subprocess.Popen]) -> list[tuple[int, str, str]]:
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=JOB_TIMEOUT)
            out.append((p.returncode, stdout, stderr))
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        pytest.fail("the two agents did not finish in time:\n" + "\n".join(p.communicate()[1] for p in procs))
    return out


def test_two_agents_print_one_job_wide_table(tmp_path):
    (tmp_path / "train.py").write_text(TRAIN_SCRIPT)
    port = _free_port()
    dirs = [tmp_path / "node-a", tmp_path / "node-b"]
    results = _finish([_agent(d, port, tmp_path) for d in dirs])
    for code, out, err in results:
        assert code == 0, out + err
    # The c10d rendezvous decides which agent's node runs rank 0.
    (node0,) = [i for i, d in enumerate(dirs) if (d / "rank0.json").exists()]
    home, away = dirs[node0], dirs[1 - node0]
    out0, out1 = results[node0][1], results[1 - node0][1]

    # Rank 1 wrote its own files on its node; rank 0 received them through the job's store.
    assert sorted(p.name for p in away.glob("rank*.json")) == ["rank1.json"]
    assert json.loads((home / "rank1.json").read_text())["rank"] == 1
    job = json.loads((home / "job.json").read_text())
    assert job["ranks"]["1"]["stats_dir"] == str(away) and job["ranks"]["1"]["final"], job
    assert job["missing"] == [] and job["not_final"] == [], job

    # Node 0's launcher prints the whole job: both ranks, the plan check between them.
    assert "ranks 2 of 2" in out0, out0
    assert "no report from rank" not in out0 + results[node0][2]
    assert "bucket plans: identical on all 2 ranks" in out0, out0
    assert f"gathered through the job's store: rank(s) 1 from {socket.gethostname()}:{away}" in out0, out0
    # ... and both ranks' runtime views: 3 warm-up steps, then the last 3 steps, whose profile
    # ends at exit, after destroy_process_group(); every bucket a row.
    assert "median over 2 rank(s)" in out0, out0
    for rank in (0, 1):
        assert f"rank {rank}: 3 profiled step(s)" in out0, out0
    buckets = json.loads((home / "rank0.json").read_text())["graphs"][0]["buckets"]
    assert len(buckets) >= 2
    rows = [line.split() for line in out0.split("runtime per bucket")[1].splitlines()[2 : 2 + len(buckets)]]
    assert [(r[0], r[1], r[2]) for r in rows] == [("0", str(b["index"]), "all_reduce") for b in buckets], out0
    # Each rank's trace and timeline stay on its own node.
    assert (away / "runtime-rank1.trace.json").exists() and (away / "runtime-rank1.png").exists()
    assert f"{away / 'runtime-rank1.trace.json'}" in out0

    # The other launcher says where the table is instead of printing half of it.
    assert "compile s min" not in out1, out1
    assert "rank(s) 1 of 2 wrote their files into" in out1, out1
    assert f"the job-wide table is printed by `bucketwise launch` on {socket.gethostname()}" in out1, out1
    assert str(home) in out1, out1


# -- bucketwise.profile on CPU -------------------------------------------------------------


def _ids(rank: int, step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(100 * rank + step))


def _profile_worker(rank: int, world: int, out_dir: str) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.manual_seed(0)
    ddp = DDP(Lookups(), bucket_cap_mb=0.001)
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    compiled = bucketwise.compile(ddp, backend="aot_eager", strategy="fused")
    opt = torch.optim.SGD(compiled.parameters(), lr=0.1)

    def step(i: int) -> None:
        compiled(_ids(rank, i)).backward()
        opt.step()
        opt.zero_grad()

    for i in range(3):
        step(i)
    with bucketwise.profile(compiled, out_dir=out_dir) as prof:
        for i in range(3, 6):
            step(i)
        with torch.no_grad():
            compiled(_ids(rank, 0))  # evaluation: not a step
    return {"view": prof.view.to_dict(), "report": bucketwise.report(compiled).to_dict(), "table": prof.table()}


def test_profile_finds_every_bucket_and_its_wire_bytes(tmp_path):
    out_dir = tmp_path / "prof"
    results = run_distributed(_profile_worker, tmp_path, args=(str(out_dir),), timeout=300)
    for rank, r in enumerate(results):
        view = RuntimeView.from_dict(r["view"])
        assert view.to_dict() == r["view"]
        assert view.rank == rank and view.steps == 3 and view.source == "cpu", view
        # The process's CPU time per step beside the step's wall time (NOTE [a step's CPU time]);
        # no CUDA memory on a CPU run.
        assert view.cpu_ms > 0 and view.peak_allocated_mib is None and view.reserved_mib is None, view
        assert f"ms per step (CPU time {view.cpu_ms:.2f} ms)" in r["table"], r["table"]
        planned = {
            (g["graph_id"], b["index"]): b for g in r["report"]["graphs"] if not g["variant"] for b in g["buckets"]
        }
        assert {b["collective"] for b in planned.values()} == {"all_reduce", "all_gather rows"}, planned
        assert {b["comm_dtype"] for b in planned.values()} == {"float16"}, planned
        assert sorted((b.graph_id, b.index) for b in view.buckets) == sorted(planned)
        for b in view.buckets:
            plan = planned[(b.graph_id, b.index)]
            gathered = plan["collective"] == "all_gather rows"
            assert b.collective == ("all_gather" if gathered else "all_reduce")
            # One all-reduce per bucket and step; the table is gathered once per lookup.
            assert b.calls == (2 if gathered else 1), (b, view.notes)
            # What gloo was handed is what the report says goes on the wire (fp16; rows and ids).
            assert b.measured_bytes == plan["wire_bytes"] and b.wire_bytes == plan["wire_bytes"], (b, plan)
            assert b.comm_ms > 0 and b.exposed_ms == pytest.approx(b.comm_ms - b.overlapped_ms, abs=1e-9)
        assert view.other is None, view.other
        assert view.wire_bytes == sum(b["wire_bytes"] for b in planned.values())
        assert view.comm_ms <= sum(b.comm_ms for b in view.buckets) + 1e-9
        assert "per-bucket NCCL kernel timing needs CUDA" in r["table"]
        # The last step's timeline: each collective once, labelled with its bucket.
        labels = [label for _, _, label in view.timeline["nccl"]]
        assert sorted(labels) == sorted(f"b{b.index}" for b in view.buckets for _ in range(int(b.calls))), labels
        assert (out_dir / f"runtime-rank{rank}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert json.loads((out_dir / f"runtime-rank{rank}.json").read_text()) == r["view"]
        assert any(e.get("name") == "bucketwise.step" for e in ta.load_trace(view.trace_path))


def test_profile_arguments_and_one_profile_at_a_time(tmp_path):
    with pytest.raises(TypeError, match=r"profile\(compiled\): expects an object returned by bucketwise.compile"):
        bucketwise.profile(nn.Linear(2, 2))
    compiled = bucketwise.compile(nn.Linear(4, 4), backend="aot_eager")
    with pytest.raises(TypeError, match="out_dir: expected a folder path"):
        bucketwise.profile(compiled, out_dir=3)
    with pytest.raises(TypeError, match="plot: expected True or False"):
        bucketwise.profile(compiled, plot="yes")
    with bucketwise.profile(compiled, out_dir=tmp_path, plot=False) as prof:
        with pytest.raises(RuntimeError, match="another bucketwise profile is running"):
            with bucketwise.profile(compiled, out_dir=tmp_path):
                pass
        compiled(torch.randn(2, 4)).sum().backward()
    # No process group, no collective: the view says so rather than inventing buckets.
    assert prof.view.steps == 1 and prof.view.source == "none" and prof.view.buckets == []
    assert "no collective in the trace" in prof.table()


# -- the analysis on hand-made traces ------------------------------------------------------


def _report(*graphs: list[int]) -> dict:
    """A report dict: one list of bucket wire bytes per training graph (fp32, all-reduced)."""
    return {
        "target": "DDP(Net)",
        "rank": 0,
        "world_size": 2,
        "graphs": [
            {
                "graph_id": g,
                "variant": None,
                "buckets": [
                    {"index": i, "params": ["p"], "bytes": n, "collective": "all_reduce", "wire_bytes": n}
                    for i, n in enumerate(sizes)
                ],
            }
            for g, sizes in enumerate(graphs)
        ],
    }


def _kernel(name, ts, dur, corr, **args):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr, **args}}


def _launch(ts, corr):
    return {
        "ph": "X",
        "cat": "cuda_runtime",
        "name": "cudaLaunchKernel",
        "ts": ts,
        "dur": 1,
        "args": {"correlation": corr},
    }


def _nccl(ts, dur, corr, nelems, with_meta=True):
    meta = {"Collective name": "allreduce", "In msg nelems": nelems, "dtype": "Float"} if with_meta else {}
    return _kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", ts, dur, corr, **meta)


def _cuda_step(t0: float, corr0: int, with_meta: bool = True) -> list[dict]:
    """One step: graph 1's bucket (800 B) is issued first, then graph 0's two 400 B buckets,
    then a user's all_reduce of one float; compute covers 0-100 and 250-300 of the step."""
    events = [{"ph": "X", "cat": "user_annotation", "name": "bucketwise.step", "ts": t0 - 1, "dur": 0}]
    events += [_launch(t0 + i, corr0 + i) for i in range(6)]
    events += [
        _kernel("gemm", t0, 100, corr0),
        _nccl(t0 + 50, 100, corr0 + 1, 200, with_meta),  # g1b0: 50 of 100 overlapped
        _nccl(t0 + 150, 100, corr0 + 2, 100, with_meta),  # g0b0: exposed
        _nccl(t0 + 250, 100, corr0 + 3, 100, with_meta),  # g0b1: 50 of 100 overlapped
        _kernel("triton_poi", t0 + 250, 50, corr0 + 4),
        _nccl(t0 + 400, 10, corr0 + 5, 1, with_meta),  # the loss, for logging
    ]
    return events


def _check_cuda_view(view: RuntimeView) -> None:
    rows = {(b.graph_id, b.index): b for b in view.buckets}
    assert rows[(1, 0)].measured_bytes == 800 and rows[(0, 0)].measured_bytes == 400 == rows[(0, 1)].measured_bytes
    assert {k: (b.calls, b.comm_ms, b.overlapped_ms, b.exposed_ms) for k, b in rows.items()} == {
        (1, 0): (1, 0.1, 0.05, 0.05),
        (0, 0): (1, 0.1, 0.0, 0.1),
        (0, 1): (1, 0.1, 0.05, 0.05),
    }
    assert view.other is not None and view.other.calls == 1 and view.other.measured_bytes == 4
    assert view.comm_ms == pytest.approx(0.31) and view.overlapped_ms == pytest.approx(0.1)
    assert view.wire_bytes == 1604 and view.source == "cuda"


def test_cuda_trace_buckets_by_size_then_issue_order():
    events = _cuda_step(0, 0) + _cuda_step(10_000, 100)
    view = analyze(events, _report([400, 400], [800]), steps=2, step_ms=5.0)
    _check_cuda_view(view)
    assert [label for _, _, label in view.timeline["nccl"]] == ["g1b0", "g0b0", "g0b1", "other"]
    assert view.timeline["window"] == "the last profiled step" and view.timeline["compute"] == [[0.0, 0.1], [0.25, 0.3]]


def test_cuda_trace_without_kernel_metadata_uses_record_param_comms():
    events = _cuda_step(0, 0, with_meta=False) + _cuda_step(10_000, 100, with_meta=False)
    starts = sorted(e["ts"] for e in events if "nccl" in e["name"])
    sizes = [200, 100, 100, 1] * 2
    events += [
        {
            "ph": "X",
            "cat": "cpu_op",
            "name": "record_param_comms",
            "ts": ts - 0.5,
            "dur": 0.1,
            "args": {"Collective name": "allreduce", "In msg nelems": n, "dtype": "Float"},
        }
        for ts, n in zip(starts, sizes)
    ]
    _check_cuda_view(analyze(events, _report([400, 400], [800]), steps=2, step_ms=5.0))


def test_cpu_trace_host_compute_excludes_waits():
    def ev(cat, name, tid, ts, dur, **args):
        return {"ph": "X", "cat": cat, "name": name, "tid": tid, "ts": ts, "dur": dur, "args": args}

    events = [
        ev("user_annotation", "bucketwise.step", 1, 0, 0),
        ev("cpu_op", "autograd::engine::evaluate_function: CompiledFunctionBackward", 1, 0, 500),
        ev("cpu_op", "_c10d_functional::wait_tensor", 1, 300, 200),  # waiting: not compute
        ev(
            "user_annotation", "gloo:all_reduce", 7, 200, 200, **{"Input Dims": [[64]], "Input type": ["c10::BFloat16"]}
        ),
    ]
    view = analyze(events, _report([128]), steps=1, step_ms=1.0)
    (b,) = view.buckets
    assert (b.measured_bytes, b.comm_ms, b.overlapped_ms, b.exposed_ms) == (128, 0.2, 0.1, 0.1)
    assert view.timeline["nccl"] == [[0.2, 0.4, "b0"]] and view.timeline["compute"] == [[0.0, 0.3]]


# -- what the launchers print, from the files ------------------------------------------------


def _rank_file(folder, rank: int, world: int) -> None:
    from bucketwise.stats.report import GraphStats, Report, SegmentStats

    rep = Report(target="DDP(MLP)", strategy="split", backend="aot_eager")
    rep.graphs.append(
        GraphStats(
            graph_id=0,
            compile_id="0/0",
            strategy="split",
            strategy_reason=None,
            graph_break_reasons=[],
            recompile=False,
            op_count=3,
            higher_order_ops=[],
            segments=[
                SegmentStats(index=0, params=["w"], bytes=4, op_count=3, compile_seconds=1.0, backend="aot_eager")
            ],
        )
    )
    data = rep.to_dict()
    data.update(rank=rank, world_size=world)
    folder.mkdir(exist_ok=True)
    (folder / f"rank{rank}.json").write_text(json.dumps(data))


def test_what_each_launcher_prints_from_the_gathered_files(tmp_path, capsys, monkeypatch):
    from bucketwise.launch import cli, launcher

    monkeypatch.delenv("BUCKETWISE_STATS_DIR", raising=False)
    home, away = tmp_path / "home", tmp_path / "away"
    for r in range(3):
        _rank_file(home, r, 4)  # rank 1 and 2 came through the store, rank 3 never did
    _rank_file(away, 1, 4)
    folders = {"0": str(home), "1": str(away), "2": str(away)}
    (home / "job.json").write_text(
        json.dumps(
            {
                "schema": 1,
                "world_size": 4,
                "gathered_by": {"rank": 0, "host": "h0", "stats_dir": str(home)},
                "ranks": {
                    r: {"host": "h0" if d == str(home) else "h1", "stats_dir": d, "final": r != "2"}
                    for r, d in folders.items()
                },
                "not_final": [2],
                "missing": [3],
                "waited_s": 60.0,
            }
        )
    )
    (away / "job.json").write_text(
        json.dumps({"schema": 1, "world_size": 4, "gathered_by": {"rank": 0, "host": "h0", "stats_dir": str(home)}})
    )

    assert launcher.summarize(str(home))
    out = capsys.readouterr().out
    assert "ranks 3 of 4" in out and "no report from rank(s) 3" in out, out
    assert f"gathered through the job's store: rank(s) 1-2 from h1:{away}" in out, out
    assert "rank(s) 2 sent no final report within 60 s of rank 0's end" in out, out
    assert "nothing from rank(s) 3 reached the job's store" in out, out

    assert launcher.summarize(str(away))
    out = capsys.readouterr().out
    assert "compile s min" not in out and f"rank(s) 1 of 4 wrote their files into {away}" in out, out
    assert f"printed by `bucketwise launch` on h0, the node that ran rank 0, from {home}" in out, out

    # Copies of every node's folder merge by hand when rank 0 gathered nothing.
    assert cli.main(["stats", str(away), str(home)]) == 0
    out = capsys.readouterr()
    assert "ranks 3 of 4" in out.out and "two files for rank 1; keeping the first" in out.err, out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["launch", "--profile-steps", "0", "t.py"], "--profile-steps: expected a positive integer, got '0'"),
        (
            ["launch", "--profile-steps", "2", "--profile-warmup", "soon", "t.py"],
            "--profile-warmup: expected 'auto' or an integer >= 0, got 'soon'",
        ),
    ],
)
def test_profile_flags_are_checked(argv, message, capsys):
    from bucketwise.launch import cli

    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_profile_environment_is_checked(monkeypatch):
    monkeypatch.setenv("BUCKETWISE_PROFILE_STEPS", "five")
    compiled = bucketwise.compile(nn.Linear(4, 4), backend="aot_eager")
    with pytest.raises(ValueError, match=r"\$BUCKETWISE_PROFILE_STEPS='five': expected an integer >= 1"):
        compiled(torch.randn(2, 4))
