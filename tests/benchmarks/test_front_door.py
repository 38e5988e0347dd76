"""``python -m bucketwise.benchmarks``: every harness and probe behind one command, each with its
own ``--help``; a wrong name exits 2 naming the right ones."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest

from bucketwise.benchmarks.__main__ import COMMANDS, probes


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bucketwise.benchmarks", *args], capture_output=True, text=True, timeout=120
    )


def test_without_a_command_it_lists_every_command_and_probe():
    done = _run()
    assert done.returncode == 2
    for name in (*COMMANDS, "probe", *probes()):
        assert name in done.stdout, (name, done.stdout)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_command_has_its_own_help(name):
    done = _run(name, "--help")
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"usage: python -m bucketwise.benchmarks {name}" in done.stdout, done.stdout[:500]


def test_a_probe_has_its_help_and_a_wrong_probe_is_named():
    assert probes() == [
        "compile_depth",
        "engine_grads",
        "graph_launch",
        "host_fixed_costs",
        "host_tax",
        "memory_phases",
        "powersgd_gloo",
        "step_kernels",
        "trace_kernels",
    ]
    done = _run("probe", "nope")
    assert done.returncode == 2
    assert (
        "expected one of ['compile_depth', 'engine_grads', 'graph_launch', 'host_fixed_costs', 'host_tax', "
        "'memory_phases', 'powersgd_gloo', "
        "'step_kernels', 'trace_kernels'], "
        "got 'nope'" in done.stderr
    )


@pytest.mark.parametrize("probe", ["graph_launch", "memory_phases", "step_kernels"])
def test_a_one_gpu_probe_names_an_unknown_config_before_it_needs_a_gpu(probe):
    done = _run("probe", probe, "--configs", "bw-fused,nope")
    assert done.returncode == 2
    assert "--configs: unknown config 'nope'; known configs: eager," in done.stderr, done.stderr[-500:]


def test_host_fixed_costs_times_every_candidate_of_every_line_on_the_cpu():
    done = _run("probe", "host_fixed_costs", "--rounds", "1", "--calls", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" {", 1) for line in done.stdout.splitlines() if " {" in line)
    expected = {
        "collectives (us per call)": [
            "compiled, one tiny kernel",
            "compiled, 1 all-reduce",
            "compiled, 4 all-reduces",
            "eager, 4 all-reduces",
        ],
        "forward only, grad enabled (us)": ["module", "eager DDP", "local", "bw-auto", "torch.compile(DDP)"],
        "forward+backward (us)": ["module", "eager DDP", "local", "bw-auto", "torch.compile(DDP)"],
        "forward, no_grad (us)": ["local", "bw-auto"],
    }
    assert list(lines) == list(expected), done.stdout
    for title, names in expected.items():
        medians = ast.literal_eval("{" + lines[title])
        assert list(medians) == names and all(us > 0 for us in medians.values()), (title, medians)


def test_compile_depth_runs_each_depth_cold_and_gives_the_slope_per_block():
    import json

    done = _run("probe", "compile_depth", "--layers", "3,2", "--backend", "aot_eager")
    assert done.returncode == 0, done.stderr[-3000:]
    runs = [json.loads(line[len("DEPTH ") :]) for line in done.stdout.splitlines() if line.startswith("DEPTH ")]
    assert [r["layers"] for r in runs] == [2, 3]
    for r in runs:
        # Every phase was timed, and the shared block's compile is part of AOTAutograd and backend.
        assert all(r[k] > 0 for k in ("dynamo_s", "aot_autograd_s", "first_step_s")), r
        assert 0 < r["block_s"] <= r["aot_autograd_s"] + r["backend_s"] + 1e-6, r
    slope = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("SLOPE "))[len("SLOPE ") :])
    assert slope["between"] == [2, 3]
    dynamo = slope["dynamo_s"]
    assert abs(dynamo["per_block_s"] - (runs[1]["dynamo_s"] - runs[0]["dynamo_s"])) < 1e-3
    assert abs(dynamo["at_no_blocks_s"] + 2 * dynamo["per_block_s"] - runs[0]["dynamo_s"]) < 2e-3


def test_compile_depth_floor_times_each_depth_with_opaque_blocks(tmp_path):
    import json

    out = tmp_path / "out"
    done = _run("probe", "compile_depth", "--layers", "2,3", "--backend", "aot_eager", "--floor", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    runs = [json.loads(line[len("FLOOR ") :]) for line in done.stdout.splitlines() if line.startswith("FLOOR ")]
    assert [r["layers"] for r in runs] == [2, 3] and all(r["first_step_s"] > 0 for r in runs), runs
    line = next(line for line in done.stdout.splitlines() if line.startswith("FLOOR_SLOPE "))
    slope = json.loads(line[len("FLOOR_SLOPE ") :])
    assert slope["between"] == [2, 3] and set(slope) == {"between", "first_step_s"}, slope
    assert abs(slope["first_step_s"]["per_block_s"] - (runs[1]["first_step_s"] - runs[0]["first_step_s"])) < 1e-3
    # --out: what it printed, with the run's meta (the code that ran included).
    written = json.loads((out / "results.json").read_text())
    assert written["depths"] == runs and written["slope"] == slope
    meta = written["meta"]
    assert meta["variant"] == "floor" and meta["backend"] == "aot_eager" and meta["model"] == "llama", meta
    assert "probe compile_depth" in meta["command"] and "source_tree" in meta and meta["sizes"]["d_model"] == 64


def test_compile_depth_needs_two_depths():
    done = _run("probe", "compile_depth", "--layers", "8")
    assert done.returncode == 2
    assert "--layers: expected two or more depths of 2 blocks or more, got '8'" in done.stderr


def test_an_unknown_command_exits_2_naming_the_commands():
    done = _run("ddp_bench")
    assert done.returncode == 2
    assert "unknown command 'ddp_bench'; expected one of ['ddp', 'tax'" in done.stderr


def test_trace_kernels_sums_kernel_time_by_kind_and_compares_configs(tmp_path):
    """Two configs' kept traces, 2 profiled steps: time per step by kind, the busy time of the
    compute kernels (overlapping ones counted once, NCCL left out), and the difference."""

    def kernel(name, ts, dur):
        return {"cat": "kernel", "name": name, "ts": ts, "dur": dur}

    traces = tmp_path / "traces"
    traces.mkdir()
    floor = [
        e
        for t in (0, 10_000)
        for e in (kernel("sm90_xmma_gemm_bf16", t, 1000), kernel("triton_poi_fused__to_copy_3", t + 1000, 200))
    ]
    overlap = [
        e
        for t in (0, 10_000)
        for e in (
            kernel("sm90_xmma_gemm_bf16", t, 1400),
            kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", t + 500, 2000),
            kernel("triton_poi_fused__to_copy_mul_view_7", t + 1400, 300),
            {"cat": "cpu_op", "name": "aten::mm", "ts": t, "dur": 5000},
        )
    ]
    for config, events in (("a-floor", floor), ("b-overlap", overlap)):
        (traces / f"{config}-rank0.json").write_text(json.dumps({"traceEvents": events}))
    (traces / "b-overlap-rank1.json").write_text(json.dumps({"traceEvents": []}))
    done = _run("probe", "trace_kernels", str(tmp_path), "--steps", "2")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "a-floor: kernels/step 2, kernel ms/step 1.20, compute busy ms/step 1.20, nccl ms/step 0.00"
    assert lines[1] == "b-overlap: kernels/step 3, kernel ms/step 3.70, compute busy ms/step 1.70, nccl ms/step 2.00"
    assert lines[3] == "== b-overlap minus a-floor: kinds by ms/step difference"
    diff = {line.split()[-1]: line.split()[0] for line in lines[4:]}
    assert diff == {
        "nccl": "+2.000",
        "gemm": "+0.400",
        "triton:poi:_to_copy_mul_view": "+0.300",
        "triton:poi:_to_copy": "-0.200",
    }
    missing = _run("probe", "trace_kernels", str(tmp_path), "--rank", "3")
    assert missing.returncode == 2 and "no traces of rank 3" in missing.stderr and "--keep-traces" in missing.stderr
