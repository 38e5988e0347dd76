"""benchmarks/tax/bench.py: configs built side by side and timed in interleaved rounds (a CPU run
in a fresh process), its table regenerated from the JSON, and the ``llama`` model and
``replicate`` config it measures, trained against their floors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
RESULTS = BENCH_DIR / "results" / "2026-11-24_1xH100_ddp-tax-one-rank"


@pytest.fixture
def bench(monkeypatch):
    from bucketwise.benchmarks.core import configs as bench_configs
    from bucketwise.benchmarks.core import models as bench_models
    from bucketwise.benchmarks.tax import bench as tax_bench

    return tax_bench, bench_configs, bench_models


def test_cpu_run_interleaves_and_writes_both_files(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", MASTER_PORT="29631")
    cmd = [
        sys.executable,
        "-m",
        "bucketwise.benchmarks",
        "tax",
        "--model",
        "mlp",
        "--configs",
        "local,bw-fused",
        "--pairs",
        "3",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--backend",
        "aot_eager",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((tmp_path / "results.json").read_text())
    rows = {r["config"]: r for r in data["rows"]}
    assert set(rows) == {"local", "bw-fused"}
    for row in rows.values():
        assert len(row["issue_ms"]) == len(row["process_cpu_ms"]) == len(row["cpu_ms"]) == len(row["step_ms"]) == 3
        assert all(t > 0 for t in row["issue_ms"])
        # The issuing thread's CPU time cannot exceed the wall clock it issued in (one intra-op
        # thread, OMP_NUM_THREADS=1), and the process's holds it.
        assert all(0 < c <= t * 1.05 for c, t in zip(row["cpu_ms"], row["issue_ms"]))
        assert all(p >= c * 0.95 for p, c in zip(row["process_cpu_ms"], row["cpu_ms"]))
    # A step's CPU time in the table is the process's, unmarked (NOTE [a step's CPU time]).
    md = (tmp_path / "results.md").read_text()
    assert f"| {rows['bw-fused']['process_cpu_ms_median']:.2f} |" in md and "†" not in md
    assert rows["local"]["issue_ratio"] == 1.0
    assert rows["bw-fused"]["compile_s"] > 0 and rows["local"]["compile_s"] is None
    # What bucketwise did with the model's blocks is recorded beside its figures (an MLP has none).
    assert rows["bw-fused"]["shared_blocks"] == [None] and "shared_blocks" not in rows["local"]
    assert "`bw-fused` | `local`" in (tmp_path / "results.md").read_text()


def test_pairs_below_three_are_refused(bench):
    tax_bench = bench[0]
    with pytest.raises(SystemExit):
        tax_bench._parse(["--pairs", "2", "--out", "x"])


def test_ratio_is_the_median_of_per_round_ratios(bench):
    tax_bench = bench[0]

    def entry(issue, peak, cpu=None, process=None):
        return {
            "config": "",
            "first_step_s": 1.0,
            "compile_s": None,
            "issue_ms": issue,
            "process_cpu_ms": process or issue,
            "cpu_ms": cpu or issue,
            "step_ms": issue,
            "kernels": 10,
            "gpu_ms": 1.0,
            "rest_bytes": 0,
            "first_peak_bytes": peak,
            "peak_bytes": peak,
        }

    entries = {
        "local": {**entry([10.0, 20.0, 10.0], 100), "config": "local"},
        "bw-fused": {
            **entry([11.0, 10.0, 30.0], 110, cpu=[12.0, 40.0, 5.0], process=[13.0, 30.0, 20.0]),
            "config": "bw-fused",
        },
    }
    rows = {r["config"]: r for r in tax_bench.summarize(entries)}
    # Per-round ratios 1.1, 0.5, 3.0: the median is 1.1, not the ratio of medians (11/10).
    assert rows["bw-fused"]["issue_ratio"] == pytest.approx(1.1)
    # CPU time the same way, from its own rounds: 1.2, 2.0, 0.5.
    assert rows["bw-fused"]["cpu_ratio"] == pytest.approx(1.2)
    # The process's CPU time too: 1.3, 1.5, 2.0.
    assert rows["bw-fused"]["process_cpu_ratio"] == pytest.approx(1.5)
    assert rows["bw-fused"]["host_us_per_launch"] == pytest.approx(1100.0)


@pytest.mark.parametrize(
    "run",
    [
        f"{day}_1xH100_ddp-tax-one-rank/{model}"
        for day in ("2026-11-24", "2026-11-25")
        for model in ("gpt", "gpt-medium", "llama")
    ]
    + ["2026-11-25_1xH100_ddp-tax-one-rank/gpt-restarts"]
    + [
        "2026-11-29_1xH200_tax-llama8-16-gpu-idle/llama16",
        "2026-11-29_1xH200_tax-llama16-32-b12-shared-blocks/llama32b12",
        "2026-11-29_1xH200_tax-llama32-torch-local-ro/llama32",
        "2026-11-29_1xH200_tax-llama16-32-b4-process-cpu-shared-blocks/llama16",
        "2026-11-29_1xH200_tax-llama8-16-b4-9-rounds-process-cpu/llama8",
    ],
)
def test_committed_tables_are_generated_from_their_json(bench, run, tmp_path):
    tax_bench = bench[0]
    folder = RESULTS.parent / run
    (tmp_path / "results.json").write_text((folder / "results.json").read_text())
    tax_bench.rewrite_markdown(str(tmp_path))
    assert (tmp_path / "results.md").read_text() == (folder / "results.md").read_text()


def test_replicate_and_llama_train_like_the_local_floor(bench, single_rank_group):
    _, bench_configs, bench_models = bench
    pytest.importorskip("transformers")
    spec = bench_models.make_spec("llama", {"layers": 1, "d_model": 32, "heads": 4, "seq": 8, "batch": 2, "vocab": 64})
    losses = {}
    for config in ("local", "replicate"):
        torch.manual_seed(0)
        model = spec.build()
        prepared = bench_configs.CONFIGS[config].prepare(
            model, device=torch.device("cpu"), backend="eager", bucket_cap_mb=None
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        batch = spec.make_batch(1, torch.device("cpu"))
        for _ in range(3):
            loss = spec.loss(prepared.module, batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses[config] = loss.item()
    assert dist.get_world_size() == 1
    assert losses["replicate"] == pytest.approx(losses["local"], rel=1e-5)


def test_replicate_recipe_checks_its_fields(bench):
    bench_configs = bench[1]
    with pytest.raises(ValueError, match="replicate"):
        bench_configs.Recipe(compiler="torch", replicate=True)  # ddp=True left on


@pytest.mark.inductor
def test_restarts_run_cold_then_warm_in_new_processes(bench, monkeypatch):
    """A cold first step in a new process over empty caches, then a warm one over the same
    caches: the warm process loads the fused graph from the AOTAutograd cache, and the report's
    first-step breakdown accounts for the compiled calls. Then a fresh machine: a new process
    over empty caches that loads the cold process's compiled artifacts finds every graph there."""
    from bucketwise.benchmarks.tax import restarts as tax_restarts

    monkeypatch.setenv("MASTER_PORT", "29633")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    result = tax_restarts.run_restarts("mlp", ["bw-fused"], "inductor", 1, timeout_s=300)
    (run,) = result["runs"]["bw-fused"]
    cold, warm = run["cold"], run["warm"]
    assert "error" not in cold and "error" not in warm, run
    assert cold["compile_times"]["aot_autograd_cache"]["miss"] == 1
    assert warm["compile_times"]["aot_autograd_cache"]["hit"] == 1
    # The summary counts the cold graphs the report looked up.
    cold_fx = cold["compile_times"]["fx_graph_cache"]
    assert cold_fx["miss"] >= 1
    summary = result["summary"]["bw-fused"]
    assert summary["cold_fx_graphs"] == cold_fx["miss"] + cold_fx["hit"] + cold_fx["bypass"]
    for r in (cold, warm):
        first = r["first_step"]
        assert 0 < first["compiled_calls_s"] <= r["first_step_s"]
    assert result["summary"]["bw-fused"]["cold_s"] == cold["first_step_s"]
    fresh = run["fresh"]
    assert "error" not in fresh, run
    fresh_times = fresh["compile_times"]
    assert fresh_times["aot_autograd_cache"]["hit"] == 1 and fresh_times["aot_autograd_cache"]["miss"] == 0
    assert fresh_times["fx_graph_cache"]["miss"] == 0, fresh_times
    assert summary["fresh_fx_hits"] == fresh_times["fx_graph_cache"]["hit"]
    assert summary["fresh_restart_s"] == fresh["prepare_s"] + fresh["first_step_s"]
    assert summary["fresh_over_warm"] == pytest.approx(
        summary["fresh_restart_s"] / (warm["prepare_s"] + warm["first_step_s"])
    )


def test_restart_ratios_are_medians_of_per_round_ratios(bench):
    from bucketwise.benchmarks.tax import restarts as tax_restarts

    run = lambda cold, warm: {"cold": {"first_step_s": cold}, "warm": {"first_step_s": warm}}  # noqa: E731
    runs = {
        "torch": [run(10.0, 2.0), run(20.0, 2.0), run(10.0, 2.0)],
        "bw-fused": [run(11.0, 1.0), run(10.0, 1.0), run(30.0, 2.0)],
        "bw-fused-cg": [run(12.0, 1.2), run(12.0, 1.5), {"cold": {"error": "x"}, "warm": {"error": "x"}}],
    }
    summary = tax_restarts.summarize(runs)
    # Per-round ratios 1.1, 0.5, 3.0: the median is 1.1.
    assert summary["bw-fused"]["cold_over_torch"] == pytest.approx(1.1)
    # The failed round is left out: warm ratios 1.2 and 1.5.
    assert summary["bw-fused-cg"]["warm_over_uncaptured"] == pytest.approx(1.35)
    assert "cold_over_torch" not in summary["torch"] and "warm_over_uncaptured" not in summary["bw-fused"]
    md = bench[0].markdown(
        {"model": "gpt", "gpu": "GPU", "device": "cuda", "world_size": 1, "torch": "2.11", "date": "d", "command": "c"},
        [],
        {"rounds": 3, "summary": summary},
    )
    assert "| `bw-fused` | 11.00 | 1.100 | 1.00 | - | - | - |" in md


def test_the_idle_lines_give_the_gpu_busy_share_the_runtime_view_reads(bench, tmp_path):
    """Kernel time over kernel time plus idle, per config: 102.89 / (102.89 + 6.56) is 94% for the
    whole graph at batch 12, 99.22 / (99.22 + 24.10) 80% for the shared blocks."""
    tax_bench = bench[0]
    folder = RESULTS.parent / "2026-11-29_1xH200_tax-llama16-32-b12-shared-blocks/llama32b12"
    (tmp_path / "results.json").write_text((folder / "results.json").read_text())
    tax_bench.rewrite_markdown(str(tmp_path))
    text = (tmp_path / "results.md").read_text()
    assert "- `bw-fused`: 6.56 (busy 94%); before" in text and "- `bw-fused-blocks`: 24.10 (busy 80%); before" in text
