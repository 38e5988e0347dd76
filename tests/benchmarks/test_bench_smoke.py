"""The DDP benchmark harness (benchmarks/ddp/bench.py): a 2-rank gloo smoke run on CPU, plus
its trace parsing and flag checking in-process."""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import subprocess
import sys

import pytest

SMOKE_CONFIGS = ("eager", "torch", "torch-nosplit", "local", "bw-split", "bw-none", "bw-fused")
TIMING_FIELDS = ("median_ms", "min_ms", "max_ms", "mean_ms", "first_step_s", "throughput_per_s", "floor_ratio")
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


@pytest.fixture
def bench(monkeypatch):
    from bucketwise.benchmarks.core import metrics as bench_metrics
    from bucketwise.benchmarks.ddp import cli as bench_cli

    return bench_cli, bench_metrics


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its ranks: the process group we started
        out, _ = proc.communicate()
        pytest.fail(f"benchmark timed out after {timeout} s:\n{out[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)


def _check_numbers(row: dict) -> None:
    for key, value in row.items():
        if isinstance(value, float) and key != "param_spread":
            assert math.isfinite(value) and value > 0, (row["config"], key, value)
    for key in TIMING_FIELDS:
        assert isinstance(row[key], float) and row[key] > 0, (row["config"], key, row[key])
    if row["config"].startswith("bw-"):
        assert row["compile_s"] > 0, row
        assert row["bucketwise"]["fallbacks"] == 0, row["bucketwise"]


def _check_steps(row: dict, steps: int, total: int) -> None:
    """Per-step times, their spread, host issue times and the losses of one result row."""
    per_rank = row["per_rank"]
    assert [len(ms) for ms in per_rank["per_step_ms"]] == [steps, steps]
    slowest = per_rank["per_step_ms"][per_rank["slowest_rank"]]
    spread = row["spread"]
    assert spread["rank"] == per_rank["slowest_rank"]
    assert spread["std_ms"] == pytest.approx(statistics.pstdev(slowest), rel=1e-3, abs=1e-3), (spread, slowest)
    assert min(slowest) - 1e-3 <= spread["p10_ms"] <= spread["p50_ms"] <= spread["p90_ms"] <= max(slowest) + 1e-3
    assert spread["p50_ms"] == pytest.approx(row["median_ms"])
    for issue in per_rank["cpu_issue_ms"]:
        assert 0 < issue["median"] <= issue["max"]
    # The process's CPU time per step (NOTE [a step's CPU time]), beside the issue time.
    for cpu in per_rank["cpu_time_ms"]:
        assert 0 < cpu["median"] <= cpu["max"]
    losses = row["losses"]
    assert losses["steps_total"] == total and len(losses["first"]) == len(losses["last"]) == min(5, total)
    assert losses["final_loss"] == losses["last"][-1] and math.isfinite(losses["final_loss"])
    assert losses["final_loss"] == pytest.approx(sum(losses["per_rank_final"]) / 2)


def test_smoke_two_gloo_ranks(tmp_path):
    out = tmp_path / "bench"
    cmd = [
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
        ",".join(SMOKE_CONFIGS),
        "--backend",
        "aot_eager",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--host-profile",
        "1",
        "--out",
        str(out),
    ]
    result = _run(cmd, timeout=240)
    assert result.returncode == 0, result.stdout[-4000:]

    objs = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]
    meta, rows = objs[0], objs[1:]
    assert meta["type"] == "meta" and meta["world_size"] == 2 and meta["dist_backend"] == "gloo"
    assert "-m bucketwise.benchmarks ddp" in meta["command"] and meta["model"]["model"] == "mlp"
    assert [r["config"] for r in rows] == list(SMOKE_CONFIGS)
    assert meta["env"]["CUDA_VISIBLE_DEVICES"] is None and "NCCL_MAX_NCHANNELS" in meta["env"]
    assert meta["compile_cache"] == "off" and meta["restart"] is False
    # One round (the default): no trace of rounds in the records or the table.
    assert "rounds" not in meta and "allreduce_probe_rounds" not in meta
    assert not any(k in r for r in rows for k in ("rounds", "round_spread", "max_round_floor_ratio", "round"))
    for row in rows:
        assert "error" not in row, row.get("traceback", row)
        assert row["type"] == "result" and row["status"] == "ok"
        assert row["timed_steps"] == 2
        assert row["warm_first_step_s"] is None, "no --restart"
        _check_numbers(row)
        _check_steps(row, steps=2, total=4)
    assert next(r for r in rows if r["config"] == "local")["floor_ratio"] == 1.0
    # Same seed, weights and data in every config: every DDP config trains like eager DDP.
    eager = next(r for r in rows if r["config"] == "eager")["losses"]
    for row in rows:
        if row["config"] != "local":
            assert row["losses"]["first"] == pytest.approx(eager["first"], rel=1e-4), row["config"]
            assert row["losses"]["final_loss"] == pytest.approx(eager["final_loss"], rel=1e-4), row["config"]
            # Data parallelism kept every replica equal (checked by a collective after training).
            assert row["param_spread"] == 0.0, row["config"]
        else:
            assert row["param_spread"] is None

    md = (out / "results.md").read_text()
    for config in SMOKE_CONFIGS:
        assert sum(line.startswith(f"| {config} |") for line in md.splitlines()) == 1, config
    assert "round" not in md.lower()
    png = (out / "step_time.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    # --host-profile: rank 0's cProfile of one more step per config, the DDP forward in it.
    assert sorted(p.name for p in (out / "host_profile").iterdir()) == sorted(f"{c}.txt" for c in SMOKE_CONFIGS)
    assert "distributed.py" in (out / "host_profile" / "eager.txt").read_text()


@pytest.mark.inductor
def test_restart_loads_from_the_compile_caches(tmp_path):
    """--restart: the job, then the same job over its compile caches. The first job's first steps
    are cold (each config its own empty cache dir: only misses), the restarted job's load every
    graph from the AOTAutograd cache, the fused one included (NOTE [compile cache keys]), as its
    report counts them; the cache root is removed afterwards."""
    out = tmp_path / "bench"
    configs = ("torch-nosplit", "bw-fused")
    cmd = [
        sys.executable,
        "-m",
        "bucketwise.benchmarks",
        "ddp",
        "--nproc",
        "2",
        "--device",
        "cpu",
        "--model",
        "gpt-tiny",
        "--layers",
        "1",
        "--d-model",
        "32",
        "--heads",
        "2",
        "--seq",
        "16",
        "--batch",
        "2",
        "--vocab",
        "64",
        "--configs",
        ",".join(configs),
        "--steps",
        "2",
        "--warmup",
        "1",
        "--restart",
        "--out",
        str(out),
    ]
    result = _run(cmd, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:]
    meta, *rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]
    assert meta["compile_cache"] == "on" and meta["restart"] is True
    assert [r["config"] for r in rows] == list(configs)
    for row in rows:
        assert row["status"] == "ok" and "warm_error" not in row, row
        assert row["first_step_s"] > 0 and row["warm_first_step_s"] > 0
        assert len(row["per_rank"]["warm_first_step_s"]) == 2
    fused = rows[-1]
    cold, warm = fused["bucketwise"]["compile_times"], fused["warm_compile_times"]
    assert cold["fx_graph_cache"]["hit"] == 0 and cold["fx_graph_cache"]["miss"] >= 2, cold
    assert cold["aot_autograd_cache"] == {"hit": 0, "miss": 1, "bypass": 0}, cold
    assert warm["aot_autograd_cache"] == {"hit": 1, "miss": 0, "bypass": 0}, warm
    assert warm["fx_graph_cache"]["miss"] == 0 and warm["fx_graph_cache"]["hit"] >= 2, warm
    assert cold["backend_s"] > 0 and warm["backend_s"] == 0 and warm["backward_compiles"] == 0
    assert rows[0]["warm_compile_times"] is None, "torch's configs have no report"
    md = (out / "results.md").read_text()
    assert "warm first step s" in md and "| bw-fused | 0/2/0 | 2/0/0 | 0/1/0 | 1/0/0 |" in md, md
    root = next(line.split(" in ", 1)[1].strip() for line in result.stdout.splitlines() if line.startswith("restart: "))
    assert not os.path.exists(root), "the compile caches of the job are removed"


def test_restart_flag_checks(bench):
    bench_cli, _ = bench
    with pytest.raises(SystemExit):
        bench_cli.parse(["--restart", "--compile-cache", "off", "--device", "cpu"])
    args = bench_cli.parse(["--restart", "--device", "cpu", "--configs", "local"])
    assert args.compile_cache == "on" and args.phase == "cold"
    assert bench_cli.parse(["--device", "cpu", "--configs", "local"]).compile_cache == "off"
    assert bench_cli.job_env(args)["TORCHINDUCTOR_AUTOGRAD_CACHE"] == "1"


def test_ranks_started_under_torchrun_need_the_compile_cache_variables(bench):
    """Torch reads the compile-cache variables when it is imported: a rank whose environment
    does not say what --compile-cache asks stops naming them (unset reads as torch's default, on)."""
    bench_cli, _ = bench
    off = bench_cli.parse(["--device", "cpu", "--configs", "local"])
    on = bench_cli.parse(["--device", "cpu", "--configs", "local", "--compile-cache", "on"])
    assert "TORCHINDUCTOR_FX_GRAPH_CACHE=0 TORCHINDUCTOR_AUTOGRAD_CACHE=0" in bench_cli.cache_env_errors(off, {})
    assert bench_cli.cache_env_errors(off, bench_cli.job_env(off)) is None
    assert bench_cli.cache_env_errors(on, {}) is None
    assert bench_cli.cache_env_errors(on, bench_cli.job_env(off)) is not None


def test_overlap_from_trace(bench):
    _, bm = bench

    def kernel(name, ts, dur, corr):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}

    def launch(ts, corr):
        return {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "ts": ts,
            "dur": 1,
            "args": {"correlation": corr},
        }

    events = [
        {"ph": "X", "cat": "user_annotation", "name": bm.BACKWARD_RANGE, "ts": 0, "dur": 100},
        launch(1, 1),
        launch(2, 2),
        launch(3, 3),
        launch(200, 4),
        kernel("gemm", 1000, 500, 1),  # compute 1000-1500
        kernel("ncclDevKernel_AllReduce_Sum_f32", 1200, 600, 2),  # NCCL 1200-1800: 300 overlapped
        kernel("triton_fused", 1700, 200, 3),  # compute 1700-1900: 100 more overlapped
        kernel("adamw", 2000, 100, 4),  # launched after the backward range
    ]
    o = bm.overlap_from_events(events, steps=2)
    assert o["nccl_ms"] == pytest.approx(0.6) and o["overlapped_ms"] == pytest.approx(0.4)
    assert o["exposed_ms_per_step"] == pytest.approx(0.1) and o["compute_kernels"] == 3
    t = bm.backward_timeline(events)
    assert t["kernels"] == 3 and t["compute"] == [[0.0, 0.5], [0.7, 0.9]]
    assert [n[:2] for n in t["nccl"]] == [[0.2, 0.8]]


def test_intervals(bench):
    _, bm = bench
    a = bm.merge([(5, 7), (0, 2), (1, 3), (7, 8)])
    assert a == [(0, 3), (5, 8)]
    assert bm.intersection_length(a, bm.merge([(2, 6), (7.5, 9)])) == pytest.approx(2.5)


def test_two_node_agents(tmp_path):
    # --net 2node: two `bucketwise launch --nnodes 2 --nproc-per-node 1` agents on this host, one
    # rank each, meeting through a c10d rendezvous on loopback (gloo here, NCCL over TCP on GPUs).
    out = tmp_path / "bench"
    cmd = [
        sys.executable,
        "-m",
        "bucketwise.benchmarks",
        "ddp",
        "--net",
        "2node",
        "--device",
        "cpu",
        "--model",
        "mlp",
        "--configs",
        "eager,bw-fused",
        "--backend",
        "aot_eager",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--out",
        str(out),
    ]
    result = _run(cmd, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]
    assert result.stdout.count("launching: ") == 2 and "--nnodes 2 --nproc-per-node 1" in result.stdout
    objs = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]
    meta, rows = objs[0], objs[1:]
    assert meta["net"] == "2node" and meta["world_size"] == 2, meta
    assert [r["config"] for r in rows] == ["eager", "bw-fused"] and all(r["status"] == "ok" for r in rows), rows
    eager, fused = (r["losses"] for r in rows)
    assert fused["final_loss"] == pytest.approx(eager["final_loss"], rel=1e-4)
    assert rows[1]["param_spread"] == 0.0
    # Each agent kept its own stats folder; the node that ran rank 0 printed the job-wide table.
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("stats-node")) == ["stats-node0", "stats-node1"]
    assert "ranks 2 of 2" in result.stdout, result.stdout[-3000:]


def test_two_node_flag_checks(bench, capsys):
    cli, _ = bench
    assert cli.parse(["--device", "cpu", "--net", "2node"]).nproc == 2
    with pytest.raises(SystemExit):
        cli.parse(["--device", "cpu", "--net", "2node", "--nproc", "4"])
    assert "--net 2node runs 2 ranks, one per node" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "resnet"], "known models: gpt, gpt-medium, gpt-tiny, llama, convnet, mlp"),
        (["--configs", "eager,bw-magic"], "known configs: eager, torch, torch-nosplit, local"),
        (["--model", "mlp", "--heads", "4"], "--heads does not apply to model 'mlp'"),
        (["--configs", "eager", "--repeat", "torch"], "--repeat 'torch' is not among --configs"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--host-profile", "-1"], "--host-profile must be >= 0"),
        (["--rounds", "0"], "--rounds must be at least 1"),
        (["--rounds", "2", "--restart"], "--restart measures first steps in new processes"),
        (["--rounds", "2", "--configs", "eager", "--repeat", "eager"], "drop --repeat (eager)"),
    ],
)
def test_bad_flags(bench, capsys, argv, message):
    cli, _ = bench
    with pytest.raises(SystemExit):
        cli.parse(["--device", "cpu", *argv])
    assert message in capsys.readouterr().err


def test_spread(bench):
    _, bm = bench
    assert bm.percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert bm.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 10) == pytest.approx(1.4)
    assert bm.spread([7.0]) == {"p10_ms": 7.0, "p50_ms": 7.0, "p90_ms": 7.0, "std_ms": 0.0}
    assert bm.spread([1.0, 3.0])["std_ms"] == pytest.approx(1.0)


def test_cudagraph_configs(bench):
    from bucketwise.benchmarks.core import configs as bench_configs

    for config in ("bw-split-cg", "bw-none-cg", "bw-fused-cg", "bw-fused-ro", "local-ro"):
        recipe = bench_configs.recipe_for(config)
        assert bench_configs.floor_config(config) == "local-ro" and recipe.needs_cuda, config
    assert bench_configs.recipe_for("bw-fused-cg").cudagraphs is True
    for config in ("bw-fused", "eager", "torch#2", "local"):
        assert bench_configs.floor_config(config) == "local", config


def test_default_out(bench, monkeypatch, tmp_path):
    import datetime
    import types

    cli, _ = bench
    fixed = datetime.datetime(2026, 11, 22, 9, 30)
    monkeypatch.setattr(cli, "datetime", types.SimpleNamespace(datetime=types.SimpleNamespace(now=lambda: fixed)))
    monkeypatch.setattr(cli, "RESULTS_ROOT", tmp_path)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    first = cli.default_out("gpt", "default")
    assert first == str(tmp_path / "20261122-0930-gpt-default-gpus2,3")
    os.makedirs(first)
    assert cli.default_out("gpt", "default") == first + "-2"  # a second run in the same minute
    monkeypatch.setenv("RANK", "1")
    assert cli.default_out("gpt", "default") == first  # under torchrun: the same path on every rank


def test_memory_bench_runs_each_config_in_a_process_of_its_own(tmp_path):
    # On CPU the figures are 0 (there is no allocator to read); what is checked is the harness:
    # one process per config and round, its JSON, the table, and a bad flag named.
    out = tmp_path / "memory"
    cmd = [sys.executable, "-m", "bucketwise.benchmarks", "memory", "--model", "mlp", "--layers", "2"]
    cmd += ["--d-model", "16", "--batch", "4", "--steps", "3", "--configs", "local,bw-fused", "--rounds", "2"]
    done = _run([*cmd, "--bucket-cap-mb", "0.5", "--out", str(out), "--backend", "aot_eager"], timeout=600)
    assert done.returncode == 0, done.stdout[-4000:]
    data = json.loads((out / "results.json").read_text())
    assert [(r["config"], r["round"]) for r in data["runs"]] == [
        ("local", 0),
        ("bw-fused", 0),
        ("local", 1),
        ("bw-fused", 1),
    ]
    assert data["meta"]["command"].endswith("--backend aot_eager") and data["meta"]["steps"] == 3
    assert data["meta"]["bucket_cap_mb"] == 0.5
    assert [r["ddp_bucket_cap_mb"] for r in data["runs"]] == [None, 0.5, None, 0.5]
    from bucketwise.benchmarks.ddp.memory import FIGURES

    assert all(set(FIGURES) <= set(r) for r in data["runs"]), data["runs"]
    table = (out / "results.md").read_text()
    assert "| `bw-fused` |" in table and "after `torch.compiler.reset()` too" in table
    bad = _run([*cmd[:4], "--steps", "2", "--one", "local"], timeout=120)
    assert bad.returncode != 0 and "--steps must be >= 3" in bad.stdout
    bad = _run([*cmd[:4], "--bucket-cap-mb", "0", "--one", "local"], timeout=120)
    assert bad.returncode != 0 and "--bucket-cap-mb must be positive, got 0.0" in bad.stdout


ROUND_CONFIGS = ("local", "bw-auto", "torch-ca")


def test_rounds_build_each_config_once_and_interleave(tmp_path):
    """--rounds 3: every config built and compiled in round 1 (its first step measured there,
    nothing compiled later), the configs interleaved round by round, each row the median of its
    round medians with every round's figures, and the DDP configs still training alike."""
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "bucketwise.benchmarks", "ddp", "--nproc", "2", "--device", "cpu"]
    cmd += ["--model", "mlp", "--configs", ",".join(ROUND_CONFIGS), "--backend", "aot_eager"]
    cmd += ["--steps", "2", "--warmup", "1", "--rounds", "3", "--out", str(out)]
    result = _run(cmd, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]
    started = [line.split(" ...")[0] for line in result.stdout.splitlines() if line.endswith(" ...")]
    assert started == [f"[round {k}/3] [{i}/3] {c}" for k in (1, 2, 3) for i, c in enumerate(ROUND_CONFIGS, 1)]

    meta, *rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]
    assert meta["rounds"] == 3 and len(meta["allreduce_probe_rounds"]) == 3
    assert meta["allreduce_probe_rounds"][0] == meta["allreduce_probe"]
    assert [r["config"] for r in rows] == list(ROUND_CONFIGS)
    by = {r["config"]: r for r in rows}
    for row in rows:
        assert row["status"] == "ok", row.get("traceback", row)
        rounds = row["rounds"]
        assert [r["round"] for r in rounds] == [1, 2, 3]
        # Built once: the first step in round 1 only.
        assert ["first_step_s" in r for r in rounds] == [True, False, False]
        assert row["first_step_s"] == rounds[0]["first_step_s"] > 0
        medians = [r["median_ms"] for r in rounds]
        assert row["median_ms"] == pytest.approx(statistics.median(medians))
        spread = row["round_spread"]
        assert (spread["min_ms"], spread["max_ms"]) == (min(medians), max(medians))
        assert spread["pct"] == pytest.approx(100 * (max(medians) - min(medians)) / row["median_ms"])
        assert row["timed_steps"] == 6 and [len(ms) for ms in row["per_rank"]["per_step_ms"]] == [6, 6]
        assert all([len(ms) for ms in r["per_rank"]["per_step_ms"]] == [2, 2] for r in rounds)
        assert row["losses"]["steps_total"] == 1 + 3 * (1 + 2)
        assert row["losses"]["final_loss"] == pytest.approx(rounds[-1]["final_loss"])
        # Floor ratios: of the medians over rounds, and per round against the floor's same round.
        local = by["local"]
        assert row["floor_ratio"] == pytest.approx(row["median_ms"] / local["median_ms"])
        ratios = [mine["median_ms"] / floor["median_ms"] for mine, floor in zip(rounds, local["rounds"])]
        assert [r["floor_ratio"] for r in rounds] == pytest.approx(ratios)
        assert row["max_round_floor_ratio"] == pytest.approx(max(ratios))
    assert by["local"]["floor_ratio"] == 1.0 and by["local"]["max_round_floor_ratio"] == 1.0
    for config in ("bw-auto", "torch-ca"):
        assert by[config]["param_spread"] == 0.0, config
    assert by["torch-ca"]["losses"]["last"] == pytest.approx(by["bw-auto"]["losses"]["last"], rel=1e-4)
    md = (out / "results.md").read_text()
    assert "| round medians ms | round spread |" in md and "| max round x floor |" in md
    assert "3 interleaved rounds" in md and "per round: " in md
    for config in ROUND_CONFIGS:
        assert sum(line.startswith(f"| {config} |") for line in md.splitlines()) == 1, config


def _rank_round(median: float, losses: list[float], *, first: float | None = None) -> dict:
    """One rank's measurements of one round as the ranks hand them to ``merge_rounds``."""
    steps = [median - 1.0, median, median + 1.0]
    d = {
        "median_ms": median,
        "min_ms": min(steps),
        "max_ms": max(steps),
        "mean_ms": median,
        "per_step_ms": steps,
        "cpu_issue_ms": {"median": median / 2, "max": median},
        "cpu_time_ms": {"median": median / 4, "max": median / 2},
        "losses": losses,
        "timed_steps": len(steps),
        "peak_mib": None,
        "bucketwise": None,
        "compile_s": None,
        "param_spread": 0.0,
        "overlap": None,
        "notes": [],
    }
    if first is not None:
        d["first_step_s"] = first
    return d


def test_merge_rounds_takes_the_median_of_round_medians():
    from bucketwise.benchmarks.core.configs import recipe_for
    from bucketwise.benchmarks.core.models import make_spec
    from bucketwise.benchmarks.core.output import add_floor_ratios
    from bucketwise.benchmarks.ddp.bench import merge_rounds

    spec = make_spec("mlp", {})
    # Round medians (the slowest rank's): 12 (rank 1), 20 (rank 0), 16 (rank 1): their median is 16,
    # not the largest of the ranks' medians over rounds (rank 1's: 14).
    rounds = [
        [_rank_round(10.0, [3.0, 2.9, 2.8], first=1.0), _rank_round(12.0, [2.9, 2.8, 2.7], first=2.0)],
        [_rank_round(20.0, [2.7, 2.6]), _rank_round(14.0, [2.6, 2.5])],
        [_rank_round(11.0, [2.5, 2.4]), _rank_round(16.0, [2.4, 2.3])],
    ]
    row = merge_rounds("bw-fused", recipe_for("bw-fused"), rounds, spec)
    assert row["status"] == "ok" and row["median_ms"] == 16.0
    assert (row["min_ms"], row["max_ms"]) == (11.0, 21.0)
    assert row["round_spread"] == {"min_ms": 12.0, "max_ms": 20.0, "pct": 50.0}
    assert [r["median_ms"] for r in row["rounds"]] == [12.0, 20.0, 16.0]
    assert [r["spread"]["rank"] for r in row["rounds"]] == [1, 0, 1]
    assert row["first_step_s"] == 2.0 and row["rounds"][0]["first_step_s"] == 2.0
    assert row["throughput_per_s"] == pytest.approx(spec.items_per_batch * 2 / 0.016)
    assert row["timed_steps"] == 9 and row["losses"]["steps_total"] == 7
    assert row["losses"]["final_loss"] == pytest.approx(2.35) and row["losses"]["per_rank_final"] == [2.4, 2.3]

    floor_rounds = [[_rank_round(m, [1.0], first=0.5 if k == 0 else None)] * 2 for k, m in enumerate((10.0, 10.0, 8.0))]
    floor = merge_rounds("local", recipe_for("local"), floor_rounds, spec)
    rows = [floor, row]
    add_floor_ratios(rows)
    assert floor["floor_ratio"] == 1.0 and row["floor_ratio"] == pytest.approx(1.6)
    assert [r["floor_ratio"] for r in row["rounds"]] == pytest.approx([1.2, 2.0, 2.0])
    assert row["max_round_floor_ratio"] == pytest.approx(2.0)

    failed = [rounds[0], [rounds[1][0], {"error": "Traceback ...\nRuntimeError: boom"}]]
    row = merge_rounds("bw-fused", recipe_for("bw-fused"), failed, spec)
    assert row["status"] == "error" and row["round"] == 2 and "rank 1: RuntimeError: boom" in row["error"]
