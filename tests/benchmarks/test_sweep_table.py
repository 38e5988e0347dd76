"""benchmarks/tables/sweep.py on real harness output: two 2-rank gloo runs of the ddp harness with
different ``--bucket-cap-mb``, started at the same time (each torchrun ``--standalone`` must find
its own rendezvous port), then the sweep table and plot of the two."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest

CAPS = ("0.1", "1")
CONFIGS = ("eager", "bw-fused")
LAUNCH_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "BUCKETWISE_BENCH_ARGV",
    "BUCKETWISE_BENCH_COMMAND",
)


def _bench_cmd(out: Path, cap: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "bucketwise.benchmarks",
        "ddp",
        "--nproc",
        "2",
        "--device",
        "cpu",
        "--model",
        "mlp",
        "--configs",
        ",".join(CONFIGS),
        "--backend",
        "aot_eager",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--bucket-cap-mb",
        cap,
        "--out",
        str(out),
    ]


def _run_together(cmds: list[list[str]], timeout: float) -> list[tuple[int, str]]:
    """Start every command at once; their exit codes and outputs."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env["OMP_NUM_THREADS"] = "1"
    procs = [
        subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        for cmd in cmds
    ]
    results = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)  # torchrun and its ranks: the process groups we started
            out, _ = proc.communicate()
            pytest.fail(f"benchmark timed out after {timeout} s:\n{out[-4000:]}")
        results.append((proc.returncode, out))
    return results


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


def test_sweep_table_from_two_runs(tmp_path):
    runs = [tmp_path / f"cap{cap}" for cap in CAPS]
    for (rc, out), run in zip(_run_together([_bench_cmd(r, c) for r, c in zip(runs, CAPS)], timeout=180), runs):
        assert rc == 0, out[-4000:]
        meta = json.loads((run / "results.jsonl").read_text().splitlines()[0])
        assert meta["bucket_cap_mb"] == float(CAPS[runs.index(run)])

    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "bucketwise.benchmarks", "sweep-table", str(sweep), *map(str, reversed(runs))]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "warning" not in result.stderr

    lines = (sweep / "sweep.md").read_text().splitlines()
    table = [line for line in lines if line.startswith("|")]
    header = [c.strip() for c in table[0].strip("|").split("|")]
    assert header == ["bucket_cap_mb"] + [f"{c} {col}" for c in CONFIGS for col in ("ms", "x best")]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table[2:]]
    assert [r[0] for r in rows] == list(CAPS)  # sorted by cap, whatever the argument order
    for i in range(len(CONFIGS)):
        ms = [float(r[1 + 2 * i]) for r in rows]
        ratios = [float(r[2 + 2 * i]) for r in rows]
        assert all(m > 0 for m in ms) and min(ratios) == 1.0 and all(x >= 1.0 for x in ratios)
        # The table prints ms to 2 decimals and computes x best before rounding: allow both roundings.
        lo = min(ms)
        assert ratios == [pytest.approx(m / lo, abs=0.01 + (m / lo) * (0.005 / m + 0.005 / lo)) for m in ms]
    width, height = _png_size(sweep / "sweep.png")
    assert width > 300 and height > 200


def test_sweep_table_refuses_a_cap_twice(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        meta = {"type": "meta", "bucket_cap_mb": None, "model": {"model": "mlp"}}
        (tmp_path / name / "results.jsonl").write_text(json.dumps(meta) + "\n")
    cmd = [
        sys.executable,
        "-m",
        "bucketwise.benchmarks",
        "sweep-table",
        str(tmp_path / "out"),
        str(tmp_path / "a"),
        str(tmp_path / "b"),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "bucket cap 25 MiB in both" in result.stderr
