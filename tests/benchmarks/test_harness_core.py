"""``benchmarks/core``: one config vocabulary for every harness, and one way to start processes."""

from __future__ import annotations

import json
import sys
import time

import pytest

from bucketwise.benchmarks.core import names, procs
from bucketwise.benchmarks.core.configs import CONFIGS, DEFAULT_CONFIGS, recipe_for
from bucketwise.benchmarks.ddp import numerics
from bucketwise.benchmarks.tax import bench as tax


def test_every_harness_default_is_a_registered_config():
    defaults = {
        "ddp": DEFAULT_CONFIGS,
        "tax": tax.DEFAULT_CONFIGS.split(","),
        "numerics": numerics.DEFAULT_CONFIGS,
        "zoo check": names.ZOO_CHECK,
        "zoo speed": names.ZOO_SPEED,
        "hf-trainer": names.HF_TRAINER,
    }
    for harness, configs in defaults.items():
        missing = [c for c in configs if c not in CONFIGS]
        assert not missing, f"{harness}: {missing} not in core/configs.py"


def test_bw_configs_name_their_strategy():
    for name, recipe in CONFIGS.items():
        assert names.strategy_of(name) == recipe.strategy, name


def test_older_results_names_map_into_the_vocabulary():
    assert [names.canonical(n) for n in ("auto", "fused", "split", "torch_compile", "bw-fused#2", "local")] == [
        "bw-auto",
        "bw-fused",
        "bw-split",
        "torch",
        "bw-fused#2",
        "local",
    ]
    for old, new in names.LEGACY_NAMES.items():
        assert new in CONFIGS and old not in CONFIGS, old


def test_an_unknown_name_is_named_with_its_new_name():
    with pytest.raises(ValueError, match=r"--configs: unknown 'fused' \(now 'bw-fused'\), 'nope'; known: bw-fused"):
        names.check_names(["fused", "nope", "bw-fused"], ["bw-fused", "torch"])
    assert names.check_names(["torch"], ["bw-fused", "torch"]) == ["torch"]
    with pytest.raises(ValueError, match="unknown config 'nope'"):
        recipe_for("nope")


def test_run_captures_the_first_process_and_reports_its_code():
    done = procs.run(
        [procs.Proc(procs.python("-c", "import os,sys; print(os.environ['X']); sys.exit(3)"), {"X": "hi"})],
        capture=procs.Capture.ALL,
    )
    assert (done.code, done.codes, done.stdout.strip(), done.timed_out) == (3, [3], "hi", False)


def test_every_process_gets_the_nvls_settings():
    done = procs.run(
        [procs.Proc(procs.python("-c", "import os; print(os.environ['NCCL_NVLS_ENABLE'])"))], capture="all"
    )
    assert done.stdout.strip() == "0"


def test_a_failed_process_stops_the_others_after_the_grace():
    sleeper = procs.Proc(procs.python("-c", "import time; time.sleep(120)"))
    failing = procs.Proc(procs.python("-c", "raise SystemExit(2)"))
    start = time.monotonic()
    done = procs.run([sleeper, failing], grace_s=0.5)
    assert time.monotonic() - start < 60
    assert done.code == 2 and done.codes[0] not in (0, None), done


def test_the_timeout_stops_every_process():
    done = procs.run([procs.Proc(procs.python("-c", "import time; time.sleep(120)"))], timeout_s=1.0)
    assert done.timed_out and done.code == 124


def _rank(rank: int, nproc: int, store: str, fail_rank: int) -> None:
    if rank == fail_rank:
        raise SystemExit(5)
    time.sleep(120)


def test_spawned_ranks_stop_when_one_fails(tmp_path):
    start = time.monotonic()
    done = procs.spawn_ranks(_rank, (1,), nproc=2, run_dir=tmp_path, grace_s=0.5, timeout_s=100)
    assert time.monotonic() - start < 60
    assert done.codes[1] == 5 and done.codes[0] != 0 and not done.timed_out, done


def test_run_rejects_an_unknown_capture():
    with pytest.raises(ValueError, match="'some'"):
        procs.run([procs.Proc([sys.executable, "-c", "pass"])], capture="some")


def test_numerics_runs_registry_configs_against_eager_ddp(tmp_path):
    """``numerics`` on 2 gloo ranks: one JSON line per config, equal to eager DDP (fp32, aot_eager)."""
    cmd = procs.python(
        "-m", "bucketwise.benchmarks", "numerics", "--nproc", "2", "--steps", "2", "--layers", "1",
        "--d-model", "32", "--heads", "2", "--seq", "8", "--batch", "2", "--vocab", "64", "--fp32",
        "--configs", "bw-none,bw-fused", "--backend", "aot_eager",
    )  # fmt: skip
    done = procs.run([procs.Proc(cmd, {"OMP_NUM_THREADS": "1"})], timeout_s=300, capture=procs.Capture.ALL)
    assert done.code == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [(r["variant"], r["backend"]) for r in records] == [("bw-none", "aot_eager"), ("bw-fused", "aot_eager")]
    for r in records:
        assert r["loss_gap_max"] < 1e-6 and r["param_spread_across_ranks"] == 0.0, r


def test_a_result_names_the_tree_of_the_code_on_disk_as_git_would(tmp_path):
    """NOTE [the code a result ran]: the files as they are, not the checkout's commit."""
    import os
    import shutil
    import subprocess

    from bucketwise.benchmarks.core import meta

    if shutil.which("git") is None:
        pytest.skip("needs git")

    def git(*args: str) -> str:
        env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t"}
        env["GIT_COMMITTER_EMAIL"] = "t@t"
        return subprocess.run(
            ["git", "-C", str(tmp_path), *args], capture_output=True, text=True, check=True, env=env
        ).stdout.strip()

    git("init", "-q")
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "a.py").write_text("A = 1\n")
    (tmp_path / "pkg" / "sub" / "b.py").write_text("B = 2\n")
    (tmp_path / "pkg-x.txt").write_text("sorts before pkg/ in a tree\n")
    (tmp_path / "run.sh").write_text("#!/bin/sh\n")
    (tmp_path / "run.sh").chmod(0o755)
    (tmp_path / ".gitignore").write_text("*.log\n")
    git("add", "-A")
    git("commit", "-q", "-m", "one")
    assert meta.source_tree(tmp_path) == git("rev-parse", "HEAD^{tree}")

    # Another checkout's copy over this one: a changed file, a new one, one the index still
    # lists that is gone, and an ignored one. The hash is that of what is on disk, as a commit
    # of it would have it.
    (tmp_path / "pkg" / "a.py").write_text("A = 3\n")
    (tmp_path / "pkg" / "new.py").write_text("N = 1\n")
    (tmp_path / "pkg" / "sub" / "b.py").unlink()
    (tmp_path / "out.log").write_text("ignored\n")
    on_disk = meta.source_tree(tmp_path)
    assert on_disk != git("rev-parse", "HEAD^{tree}")
    git("add", "-A")
    git("commit", "-q", "-m", "two")
    assert on_disk == git("rev-parse", "HEAD^{tree}")
    assert meta.source_tree(tmp_path / "nowhere") is None


def test_gpu_idle_charges_each_gap_to_the_kernel_that_ends_it():
    from bucketwise.benchmarks.core.metrics import gpu_idle

    # a runs 0-10; b overlaps it (5-12); a gap of 8 before c (20-25); 5 before d (30-31); c
    # again after a gap of 9 (40-42). Busy: 0-12, 20-25, 30-31, 40-42 = 20 of a 42 us span.
    kernels = [(20.0, 25.0, "c"), (0.0, 10.0, "a"), (5.0, 12.0, "b"), (30.0, 31.0, "d"), (40.0, 42.0, "c")]
    out = gpu_idle(kernels, top=1)
    assert out["span_us"] == 42.0 and out["busy_us"] == 20.0 and out["idle_us"] == 22.0
    assert out["before"] == {"c": 17.0}
    assert gpu_idle([])["idle_us"] == 0.0
    # A kernel inside another's span adds neither busy time nor a gap.
    assert gpu_idle([(0.0, 10.0, "a"), (2.0, 3.0, "b")]) == {
        "span_us": 10.0,
        "busy_us": 10.0,
        "idle_us": 0.0,
        "before": {},
    }
