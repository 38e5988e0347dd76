"""The ``bucketwise`` command: ``stats`` on synthetic rank files, ``launch`` and ``demo`` through
torchrun (``--standalone``: torchrun picks a free port, so these run in parallel under xdist)."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from bucketwise.launch import cli, launcher
from bucketwise.stats.bytecode import BytecodeState
from bucketwise.stats.report import GraphStats, Report, SegmentStats
from bucketwise.stats.report_data import ReportData
from bucketwise.stats.report_format import format_table

JOB_TIMEOUT = 300
README = Path(__file__).resolve().parents[2] / "README.md"


# -- helpers -------------------------------------------------------------------------------


def _rank_report(rank: int, world: int, plan: list[list[str]], seconds: list[float]) -> dict:
    """A rank file as ``Report.to_dict()`` writes it: one graph, one segment per plan entry."""
    report = Report(target="DDP(MLP)", strategy="auto", backend="aot_eager")
    segments = [
        SegmentStats(
            index=i,
            params=names,
            bytes=1024 * 1024 * len(names),
            op_count=3 * len(names),
            compile_seconds=s,
            backend="aot_eager",
        )
        for i, (names, s) in enumerate(zip(plan, seconds))
    ]
    report.graphs.append(
        GraphStats(
            graph_id=0,
            compile_id="0/0",
            strategy="split",
            strategy_reason=None,
            graph_break_reasons=[],
            recompile=False,
            op_count=10,
            higher_order_ops=[],
            segments=segments,
        )
    )
    data = report.to_dict()
    data.update(rank=rank, world_size=world)
    return data


def _write(path, data) -> None:
    path.write_text(json.dumps(data))


PLAN = [["fc2.weight", "fc2.bias"], ["fc1.weight", "fc1.bias"]]
ODD_PLAN = [["fc2.weight"], ["fc2.bias", "fc1.weight", "fc1.bias"]]


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    """Three ranks; rank 2's bucket plan differs from rank 0's."""
    monkeypatch.delenv("BUCKETWISE_STATS_DIR", raising=False)
    d = tmp_path / "run"
    d.mkdir()
    _write(d / "rank0.json", _rank_report(0, 3, PLAN, [1.0, 0.5]))
    _write(d / "rank1.json", _rank_report(1, 3, PLAN, [3.0, 0.25]))
    _write(d / "rank2.json", _rank_report(2, 3, ODD_PLAN, [2.0, 0.75]))
    return d


def _run_cli(args: list[str], cwd, timeout: float = JOB_TIMEOUT) -> subprocess.CompletedProcess:
    """``python -m bucketwise.launch.cli ARGS`` in its own process group, killed whole on timeout."""
    env = dict(os.environ, BUCKETWISE_PROGRESS="1")
    env.pop("BUCKETWISE_STATS_DIR", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "bucketwise.launch.cli", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"bucketwise {' '.join(args)} did not finish in {timeout} s\n{out}\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


# -- stats ---------------------------------------------------------------------------------


def test_stats_merges_ranks_and_flags_differing_plan(run_dir, capsys):
    assert cli.main(["stats", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "compile s min" in out and "median" in out
    row0 = next(line.split() for line in out.splitlines() if line.split()[:2] == ["0", "0"])
    # graph, seg, params, MiB, ops, min, median, max, backend, fallbacks
    assert row0 == ["0", "0", "2", "2.00", "6", "1.00", "2.00", "3.00", "aot_eager", "-"]
    assert "ranks 3 of 3" in out
    assert "bucket plans DIFFER from rank 0 on rank(s) 2" in out
    assert "rank 2 graph 0 segment 0: only on rank 0: fc2.bias" in out
    assert "rank 2 graph 0 segment 1: only on rank 2: fc2.bias" in out
    assert "rank 1 graph" not in out


def test_stats_names_ranks_that_compile_torch_from_source(run_dir, capsys):
    """Ranks whose report says every process compiles torch's modules from source (NOTE
    [compiled bytecode]) are named, with the fix; the others are not."""
    for rank in (1, 2):
        path = run_dir / f"rank{rank}.json"
        data = json.loads(path.read_text())
        data["totals"]["python_bytecode"] = BytecodeState.EVERY_PROCESS.value
        _write(path, data)
    assert cli.main(["stats", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "warning: rank(s) 1-2 compiled torch's modules from source" in out
    assert "compileall" in out


def test_stats_json(run_dir, capsys):
    assert cli.main(["stats", str(run_dir), "--json"]) == 0
    merged = json.loads(capsys.readouterr().out)
    assert merged["ranks"] == [0, 1, 2] and merged["missing_ranks"] == []
    seg0, seg1 = merged["segments"]
    assert seg0["compile_seconds"]["min"] == 1.0
    assert seg0["compile_seconds"]["median"] == 2.0
    assert seg0["compile_seconds"]["max"] == 3.0
    assert seg0["compile_seconds"]["per_rank"] == {"0": 1.0, "1": 3.0, "2": 2.0}
    assert seg1["compile_seconds"]["median"] == 0.5
    assert {(d["rank"], d["graph_id"], d["part"], d["index"]) for d in merged["plan_differences"]} == {
        (2, 0, "segment", 0),
        (2, 0, "segment", 1),
    }


@pytest.mark.parametrize("json_flag", [["--json"], []])
def test_stats_into_a_closed_pipe_stops_quietly(run_dir, json_flag):
    """``bucketwise stats --json DIR | head``: the reader is gone before the output is written;
    no traceback, the shell's SIGPIPE exit code."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "bucketwise.launch.cli", "stats", str(run_dir), *json_flag],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.stdout.close()  # no reader: the first write that reaches the pipe fails
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_stats_compares_planned_buckets(run_dir, capsys):
    for rank, names in ((0, ["a", "b"]), (1, ["a", "c"])):
        path = run_dir / f"rank{rank}.json"
        data = json.loads(path.read_text())
        data["graphs"][0]["buckets"] = [{"index": 0, "params": names, "bytes": 8, "segment": 0}]
        path.write_text(json.dumps(data))
    (run_dir / "rank2.json").unlink()
    assert cli.main(["stats", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "rank 1 graph 0 bucket 0: only on rank 0: b; only on rank 1: c" in out
    assert "segment" not in out.split("DIFFER", 1)[1]


def test_stats_shows_fused_buckets_and_wire_bytes(run_dir, capsys):
    from bucketwise.stats.report import BucketStats

    for rank in (0, 1):
        path = run_dir / f"rank{rank}.json"
        data = json.loads(path.read_text())
        parts = {"uncompressed": 512, "P": 2 * 2**20, "Q": 2**20}
        data["graphs"][0].update(
            strategy="fused",
            comm_hook="powerSGD_hook (matrix_approximation_rank 1, start_powerSGD_iter 2)",
            buckets=[
                BucketStats(
                    index=0,
                    params=PLAN[0],
                    bytes=8 * 2**20,
                    segment=0,
                    issued_at=0.25,
                    comm_dtype="same as grads",
                    collective="all_reduce uncompressed + P + Q",
                    wire_bytes=sum(parts.values()),
                    wire_parts=parts,
                ).to_dict(),
                BucketStats(
                    index=1,
                    params=PLAN[1],
                    bytes=4 * 2**20,
                    segment=0,
                    issued_at=1.0,
                    comm_dtype="same as grads",
                    collective="all_reduce P + Q",
                    wire_bytes=2**20,
                    wire_parts={"P": 2**19, "Q": 2**19},
                ).to_dict(),
            ],
        )
        path.write_text(json.dumps(data))
    (run_dir / "rank2.json").unlink()
    assert cli.main(["stats", str(run_dir)]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if "all_reduce" in line]
    # graph, bucket, params, MiB, issued at, comm dtype (3 words), collective, wire MiB
    assert rows[0][:5] == ["0", "0", "2", "8.00", "0.25"] and rows[0][-1] == "3.00", rows
    assert rows[1][:5] == ["0", "1", "2", "4.00", "1.00"] and rows[1][-1] == "1.00", rows
    assert (
        "graph 0: powerSGD_hook (matrix_approximation_rank 1, start_powerSGD_iter 2): "
        "4.000 MiB on the wire per step for 12.000 MiB of gradients (33.3%)" in out
    )
    assert cli.main(["stats", str(run_dir), "--json"]) == 0
    merged = json.loads(capsys.readouterr().out)
    assert [b["wire_parts"] for b in merged["fused_buckets"][0]["buckets"]][1] == {"P": 2**19, "Q": 2**19}


def test_stats_identical_plans_and_missing_rank(run_dir, capsys):
    (run_dir / "rank2.json").unlink()
    assert cli.main(["stats", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "bucket plans: identical on all 2 ranks" in out
    assert "no report from rank(s) 2" in out


def test_stats_skips_partial_file(run_dir, capsys):
    (run_dir / "rank1.json").write_text('{"schema": 1, "rank": 1, "gra')
    (run_dir / "rank3.json").write_text(json.dumps({"hello": "world"}))
    assert cli.main(["stats", str(run_dir)]) == 0
    captured = capsys.readouterr()
    assert "skipping" in captured.err and "rank1.json" in captured.err and "rank3.json" in captured.err
    assert "ranks 2 of 3" in captured.out


def test_stats_single_rank_file_uses_report_table(run_dir, capsys):
    path = run_dir / "rank1.json"
    assert cli.main(["stats", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("rank 1 of 3\n")
    assert format_table(ReportData.from_dict(json.loads(path.read_text()))) in out


def test_stats_bad_paths(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["stats", str(tmp_path / "nope")])
    assert e.value.code == 2 and "no such file or folder" in capsys.readouterr().err
    assert cli.main(["stats", str(tmp_path)]) == 1
    assert "no readable rank files" in capsys.readouterr().err


# -- argument handling ---------------------------------------------------------------------


def test_launch_argument_split():
    parser = launcher.launch_parser()
    opts, script = launcher.split_at_script(
        parser, ["--nproc-per-node", "2", "--standalone", "--stats-dir", "s", "--rdzv-conf=a=1", "t.py", "--lr", "1"]
    )
    assert opts == ["--nproc-per-node", "2", "--standalone", "--stats-dir", "s", "--rdzv-conf=a=1"]
    assert script == ["t.py", "--lr", "1"]
    assert launcher.strip_option(opts, "--stats-dir") == ["--nproc-per-node", "2", "--standalone", "--rdzv-conf=a=1"]
    assert launcher.strip_option(["--stats-dir=x", "-m"], "--stats-dir") == ["-m"]
    assert launcher.split_at_script(parser, ["--standalone", "--", "t.py", "--", "x"]) == (
        ["--standalone", "--"],
        ["t.py", "--", "x"],
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["launch"], "missing SCRIPT"),
        (["launch", "--nproc-per-node", "2", "--standalone"], "missing SCRIPT"),
        (["frobnicate"], "invalid choice"),
        ([], "required"),
        (["demo", "--steps", "0"], "--steps"),
    ],
)
def test_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_demo_rejects_unknown_backend(capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "--backend", "no-such-backend"])
    assert "--backend 'no-such-backend': unknown" in capsys.readouterr().err


def test_launch_refuses_used_stats_dir(run_dir, tmp_path, capsys):
    (tmp_path / "x.py").write_text("")
    with pytest.raises(SystemExit):
        cli.main(["launch", "--standalone", "--stats-dir", str(run_dir), str(tmp_path / "x.py")])
    assert "already holds rank*.json" in capsys.readouterr().err


@pytest.fixture
def no_ranks(monkeypatch):
    """``launcher.run_torchrun`` recorded instead of run: the torchrun arguments of each call."""
    calls: list[list[str]] = []

    def record(torchrun_args, stats_dir, extra_env=None):
        calls.append(list(torchrun_args))
        return 0

    monkeypatch.setattr(launcher, "run_torchrun", record)
    return calls


@pytest.mark.parametrize("command", ["launch", "doctor"])
@pytest.mark.parametrize("mode", [[], ["--run-path"]])
def test_launch_refuses_a_missing_script_before_any_rank(tmp_path, monkeypatch, capsys, no_ranks, command, mode):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--standalone", "--nproc-per-node", "2", *mode, "nonexistent.py", "--lr", "1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"SCRIPT nonexistent.py (no such file: {os.path.join(os.getcwd(), 'nonexistent.py')}); no rank" in err
    assert "-m (--module)" in err
    assert no_ranks == [] and not (tmp_path / "bucketwise-runs").exists()


@pytest.mark.parametrize(
    "mode, script",
    [
        (["-m"], "no_such.module"),  # a module, not a file: python -m finds it, or says it cannot
        (["--module"], "no_such.module"),
        (["--no-python"], "no-such-program"),  # a program, found on PATH
        ([], "train.py"),
        ([], "-"),  # python reads the script from stdin
    ],
)
def test_launch_reads_script_as_torchrun_does(tmp_path, monkeypatch, no_ranks, mode, script):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    assert cli.main(["launch", "--standalone", "--nproc-per-node", "2", "--stats-dir", "s", *mode, script, "x"]) == 0
    assert len(no_ranks) == 1 and no_ranks[0][-len(mode) - 2 :] == [*mode, script, "x"]


def test_launch_of_a_missing_script_exits_at_once(tmp_path):
    result = _run_cli(["launch", "--standalone", "--nproc-per-node", "2", "nonexistent.py"], tmp_path, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"SCRIPT nonexistent.py (no such file: {tmp_path / 'nonexistent.py'})" in result.stderr
    assert "stats folder" not in result.stderr and not (tmp_path / "bucketwise-runs").exists()


@pytest.mark.parametrize("argv", [["--help"], ["launch", "--help"], ["stats", "--help"], ["demo", "--help"]])
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: bucketwise")
    if argv[0] in ("launch", "demo"):
        assert "--stats-dir" in out


def test_entry_point(tmp_path):
    exe = shutil.which("bucketwise")
    if exe is None:
        pytest.skip("the bucketwise console script is not installed")
    result = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "launch" in result.stdout and "stats" in result.stdout and "demo" in result.stdout


# -- launch through torchrun ---------------------------------------------------------------

TRAIN_SCRIPT = """
import sys
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import bucketwise
from bucketwise.launch.models import mlp

dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(mlp(width=64, depth=4), bucket_cap_mb=0.01)
compiled = bucketwise.compile(model, backend="aot_eager", strategy="split")
opt = torch.optim.SGD(compiled.parameters(), lr=0.1)
for step in range(3):
    torch.manual_seed(step + 10 * dist.get_rank())
    compiled(torch.randn(8, 32)).square().mean().backward()
    opt.step()
    opt.zero_grad()
print("script args", sys.argv[1:], flush=True)
dist.destroy_process_group()
"""


def test_launch_runs_job_and_merges_stats(tmp_path):
    (tmp_path / "train.py").write_text(TRAIN_SCRIPT)
    stats_dir = tmp_path / "stats"
    result = _run_cli(
        [
            "launch",
            "--nproc-per-node",
            "2",
            "--standalone",
            "--stats-dir",
            str(stats_dir),
            "--compile-artifacts",
            "compiled",
            "train.py",
            "--stats-dir",
            "mine",
        ],
        tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (stats_dir / "rank0.json").exists() and (stats_dir / "rank1.json").exists()
    # --compile-artifacts reached every rank (NOTE [compile artifacts]); aot_eager's graphs
    # go through no compile cache, so there is nothing to save.
    for rank in (0, 1):
        text = (stats_dir / f"rank{rank}.json").read_text()
        assert f"compile artifacts: none at {tmp_path / 'compiled'}/rank{rank}.bin yet" in text, text[:2000]
        assert "compile artifacts: nothing to save" in text, text[:2000]
    assert "script args ['--stats-dir', 'mine']" in result.stdout  # after SCRIPT: the script's
    assert "compile s min" in result.stdout
    assert "ranks 2 of 2" in result.stdout
    assert "bucket plans: identical on all 2 ranks" in result.stdout
    merged = json.loads(_run_cli(["stats", str(stats_dir), "--json"], tmp_path, timeout=120).stdout)
    assert merged["ranks"] == [0, 1] and len(merged["segments"]) > 1


def test_launch_propagates_failure(tmp_path):
    (tmp_path / "fail.py").write_text(
        textwrap.dedent("""
        import os, sys
        if os.environ["RANK"] == "1":
            sys.exit("rank 1 fails on purpose")
    """)
    )
    result = _run_cli(
        ["launch", "--nproc-per-node=2", "--standalone", "--stats-dir", str(tmp_path / "s"), "fail.py"], tmp_path
    )
    assert result.returncode != 0
    assert "failed with exit code" in result.stderr
    assert "no rank files" in result.stdout


# -- faults --------------------------------------------------------------------------------

CRASH_SCRIPT = """
import os, sys, time
import torch.distributed as dist
dist.init_process_group("gloo")
marker = sys.argv[1]
if dist.get_rank() == 1 and (sys.argv[2] == "always" or not os.path.exists(marker)):
    open(marker, "w").close()
    time.sleep(0.5)
    if sys.argv[2] == "kill":
        os.kill(os.getpid(), 9)
    raise RuntimeError("rank 1 blew up on purpose")
dist.barrier()  # rank 0 waits here for a peer that died: torchrun must stop it
dist.destroy_process_group()
"""


def _no_process_runs(fragment: str) -> bool:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return not any(fragment in line for line in out.splitlines())


@pytest.mark.parametrize("mode", ["always", "kill"])
def test_launch_reports_the_crashed_rank_and_leaves_no_process(tmp_path, mode):
    script = tmp_path / f"crash_{mode}.py"
    script.write_text(CRASH_SCRIPT)
    start = time.monotonic()
    result = _run_cli(
        [
            "launch",
            "--nproc-per-node",
            "2",
            "--standalone",
            "--stats-dir",
            str(tmp_path / "s"),
            str(script),
            str(tmp_path / "marker"),
            mode,
        ],
        tmp_path,
        timeout=120,
    )
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert elapsed < 30, f"took {elapsed:.1f} s to give up"
    if mode == "always":
        assert "local rank 1 (attempt 0) raised RuntimeError: rank 1 blew up on purpose" in result.stderr
        assert "local rank 0 (attempt 0) failed after a peer's failure" in result.stderr
    else:  # SIGKILL: no traceback anywhere, still a clear non-zero end
        assert "the job failed with exit code" in result.stderr
    assert _no_process_runs(str(script)), "a rank outlived the launcher"


# -- Ctrl-C (NOTE [stopping a job]) ---------------------------------------------------------

SLOW_RANKS_SCRIPT = """
import os, signal, sys, time
rank = os.environ["RANK"]
if rank == "1":
    # A rank that does not stop on SIGINT (Python swallows a KeyboardInterrupt raised in a
    # __del__ or a weakref callback, frequent while Dynamo compiles).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
with open(os.path.join(sys.argv[1], "rank" + rank + ".pid"), "w") as f:
    f.write(str(os.getpid()))
time.sleep(600)  # a long compile
"""


def _start_launch(tmp_path, script: str) -> subprocess.Popen:
    """``bucketwise launch`` of ``script`` on 2 ranks, in a process group of its own, as a terminal
    runs a command in the foreground (its Ctrl-C goes to that whole group)."""
    (tmp_path / "job.py").write_text(script)
    env = dict(os.environ)
    env.pop("BUCKETWISE_STATS_DIR", None)
    cmd = [sys.executable, "-m", "bucketwise.launch.cli", "launch", "--nproc-per-node", "2", "--standalone"]
    cmd += ["--stats-dir", str(tmp_path / "s"), "job.py", str(tmp_path)]
    return subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def _kill_leftover_ranks(tmp_path) -> None:
    """After a failed test: the ranks that wrote their pid and still run (they are in sessions of
    their own, so killing the launch's group does not reach them)."""
    for path in tmp_path.glob("rank*.pid"):
        text = path.read_text()
        if text and not _gone(int(text)):
            os.kill(int(text), signal.SIGKILL)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # a zombie has ended
    except OSError:
        return True


def _ctrl_c(proc: subprocess.Popen) -> tuple[float, str, str]:
    """Ctrl-C to the launch's process group; (seconds until the launcher ended, stdout, stderr)."""
    start = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"bucketwise launch still running 60 s after Ctrl-C\n{out}\n{err}")
    return time.monotonic() - start, out, err


def _assert_one_line(code: int, out: str, err: str) -> None:
    assert code == 130, (code, out, err)
    lines = [line for line in err.splitlines() if "interrupt" in line.lower()]
    assert len(lines) == 1 and lines[0].startswith("bucketwise: interrupted (Ctrl-C): stopping every rank"), err
    for noise in ("Traceback", "SignalException", "ChildFailedError", "KeyboardInterrupt"):
        assert noise not in out + err, err
    assert "per-bucket compile stats" not in out, out  # no run tables after an interrupt


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the ranks through /proc")
def test_ctrl_c_stops_every_rank_within_seconds(tmp_path):
    proc = _start_launch(tmp_path, SLOW_RANKS_SCRIPT)
    pid_files = [tmp_path / f"rank{r}.pid" for r in (0, 1)]
    deadline = time.monotonic() + 120
    while not all(p.exists() and p.read_text() for p in pid_files):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    pids = [int(p.read_text()) for p in pid_files]
    try:
        elapsed, out, err = _ctrl_c(proc)
        alive = [pid for pid in pids if not _gone(pid)]  # as the launcher ended
    finally:
        _kill_leftover_ranks(tmp_path)
    # Rank 0 ends on SIGINT, rank 1 on the SIGTERM 3 s later; torchrun alone waited 30 s.
    assert elapsed < 8, f"{elapsed:.1f} s\n{err}"
    assert not alive, f"ranks {alive} outlived the launcher"
    _assert_one_line(proc.returncode, out, err)
    assert f"their logs: {tmp_path / 's' / 'logs'}" in err, err


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the ranks through /proc")
def test_ctrl_c_while_torchrun_starts(tmp_path):
    proc = _start_launch(tmp_path, SLOW_RANKS_SCRIPT)
    first = proc.stderr.readline()  # the launcher is up; torchrun is importing torch
    assert first.startswith("bucketwise: stats folder"), first
    time.sleep(0.5)
    try:
        elapsed, out, err = _ctrl_c(proc)
    finally:
        _kill_leftover_ranks(tmp_path)
    assert elapsed < 8, f"{elapsed:.1f} s\n{err}"
    _assert_one_line(proc.returncode, out, first + err)
    time.sleep(0.5)
    assert _no_process_runs(str(tmp_path / "job.py")) and _no_process_runs(str(tmp_path / "s")), "a process lived on"


def test_launch_max_restarts_follows_torchrun(tmp_path):
    # No process group here: on torch 2.13 CPU a restarted gloo group fails to connect its
    # mesh (a torchrun/gloo matter, seen with plain torchrun too); restarts themselves are
    # torchrun's, bucketwise passes --max-restarts through.
    script = tmp_path / "fail_once.py"
    script.write_text(
        textwrap.dedent("""
        import os, sys
        if os.environ["RANK"] == "1" and not os.path.exists(sys.argv[1]):
            open(sys.argv[1], "w").close()
            raise RuntimeError("first attempt fails")
        print("attempt", os.environ["TORCHELASTIC_RESTART_COUNT"], "rank", os.environ["RANK"], "ok")
    """)
    )
    result = _run_cli(
        [
            "launch",
            "--nproc-per-node",
            "2",
            "--standalone",
            "--max-restarts",
            "1",
            "--stats-dir",
            str(tmp_path / "s"),
            str(script),
            str(tmp_path / "marker"),
        ],
        tmp_path,
        timeout=120,
    )
    # The first attempt fails on rank 1, torchrun restarts every rank once, the second succeeds.
    assert result.returncode == 0, result.stdout + result.stderr
    assert "attempt 1 rank 1 ok" in result.stdout
    assert list((tmp_path / "s" / "logs").glob("*/attempt_1"))


# -- doctor --------------------------------------------------------------------------------

DOCTOR_SCRIPT = """
import torch, torch.nn as nn, torch.distributed as dist
import bucketwise

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 300), nn.Linear(300, 300), nn.Linear(300, 4)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))

dist.init_process_group("gloo")
torch.manual_seed(0)
compiled = bucketwise.compile(nn.parallel.DistributedDataParallel(M(), bucket_cap_mb=0.3),
                              backend="aot_eager", strategy="split")
for _ in range(2):
    compiled(torch.randn(8, 16)).sum().backward()
dist.destroy_process_group()
"""


@pytest.mark.parametrize(
    "bad_stage, expected",
    [
        ("relu_compile_error_TESTING_ONLY", "first fails at relu_compile_error_TESTING_ONLY: ReluCompileError"),
        (
            "relu_accuracy_error_TESTING_ONLY",
            "first fails at relu_accuracy_error_TESTING_ONLY: numerics: output 0 differs",
        ),
    ],
)
def test_doctor_names_the_failing_stage_and_segment(tmp_path, monkeypatch, bad_stage, expected):
    # torch's fault-injecting test backends stand in for a broken compiler stage.
    monkeypatch.setenv("BUCKETWISE_DOCTOR_LADDER", f"eager,aot_eager,{bad_stage}")
    (tmp_path / "train.py").write_text(DOCTOR_SCRIPT)
    result = _run_cli(
        ["doctor", "--nproc-per-node", "2", "--standalone", "--stats-dir", str(tmp_path / "s"), "train.py"], tmp_path
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "checked through eager -> aot_eager -> " + bad_stage in result.stdout
    for rank in (0, 1):
        for seg in (0, 1):
            assert f"rank {rank} graph 0 segment {seg}: {expected}" in result.stdout, result.stdout
    saved = tmp_path / "s" / "doctor" / f"graph-0-segment-0-{bad_stage}-rank0.py"
    assert "torch.relu" in saved.read_text()


def test_doctor_passes_a_healthy_model(tmp_path):
    (tmp_path / "train.py").write_text(DOCTOR_SCRIPT)
    stats = str(tmp_path / "s")
    # The second of the script's two steps is profiled (closed at exit).
    profile = ["--profile-steps", "1", "--profile-warmup", "1"]
    result = _run_cli(
        ["doctor", "--nproc-per-node", "2", "--standalone", "--stats-dir", stats, *profile, "train.py"], tmp_path
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # aot_eager is the backend in use: the ladder stops there.
    assert "4 segment run(s) checked through eager -> aot_eager, 0 failing" in result.stdout
    assert "bucketwise doctor: no step was profiled" not in result.stdout, result.stdout
    # The profiler library's start/stop markers stay out of the output (NOTE [kineto's markers]).
    assert "USDT:" not in result.stdout + result.stderr, result.stderr


# -- demo ----------------------------------------------------------------------------------


def _check_demo(result, steps: int, strategy: str) -> None:
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert sum(line.startswith("step ") and " ok " in line for line in out.splitlines()) == steps
    assert "rank 0 report:" in out and "compile s" in out
    if strategy == "split":
        assert "alignment 1.00: " in out  # the reducer publishes its buckets from the 3rd step on
    else:  # auto = fused: the allreduces are in the compiled backward, the reducer is idle
        assert "issued at" in out and "alignment n/a (fused" in out
    assert "compiled losses match eager" in out
    assert "bucket plans: identical on all 2 ranks" in out


def test_demo_aot_eager(tmp_path):
    result = _run_cli(
        ["demo", "--steps", "3", "--backend", "aot_eager", "--strategy", "split", "--stats-dir", str(tmp_path / "s")],
        tmp_path,
    )
    _check_demo(result, 3, "split")
    assert (tmp_path / "s" / "rank0.json").exists()


def test_readme_names_the_demo_run_folder_as_the_demo_does(run_dir, tmp_path, monkeypatch):
    """The README's demo output names the run folder as ``bucketwise demo`` prints it: the
    default ``./bucketwise-runs/<timestamp>`` under the folder it ran in."""
    monkeypatch.chdir(tmp_path)
    args = cli.build_parser().parse_args(["demo"])
    stats_dir = cli._prepare_stats_dir(args)  # what _cmd_demo writes into, --stats-dir not given
    for rank_file in run_dir.glob("rank*.json"):
        shutil.copy(rank_file, stats_dir)
    out = io.StringIO()
    launcher.summarize(stats_dir, table=False, out=out)
    printed = next(line for line in out.getvalue().splitlines() if "per-bucket compile stats" in line)
    folder = printed.split(" from ", 1)[1]
    assert folder == os.path.join(os.getcwd(), "bucketwise-runs", os.path.basename(stats_dir))
    readme = README.read_text()
    shown = next(line for line in readme.splitlines() if line.startswith("bucketwise: per-bucket compile stats"))
    assert shown.split(" from ", 1)[1] == "<current folder>/bucketwise-runs/<timestamp>"
    assert "`./bucketwise-runs/<timestamp>`\nin the folder you run it from" in readme


@pytest.mark.skipif(torch.cuda.is_available(), reason="the demo runs on the CPU only where no GPU is visible")
def test_demo_on_cpu_says_nothing_of_cuda_graphs_or_gpus(tmp_path):
    result = _run_cli(["demo", "--steps", "1", "--backend", "aot_eager", "--stats-dir", str(tmp_path / "s")], tmp_path)
    if result.returncode != 0 or " ranks on cpu," not in result.stdout:  # a failure, not the expected one
        pytest.fail(result.stdout + result.stderr)
    said = [line for line in (result.stdout + result.stderr).splitlines() if re.search("CUDA|GPU|cudagraph", line)]
    assert said == []


@pytest.mark.inductor
def test_demo_default_backend(tmp_path):
    result = _run_cli(["demo", "--steps", "3"], tmp_path)
    _check_demo(result, 3, "auto")
    assert "inductor" in result.stdout
    assert len(os.listdir(tmp_path / "bucketwise-runs")) == 1
