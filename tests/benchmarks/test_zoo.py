"""The model zoo (benchmarks/zoo/main.py): a fast subset of its models on 2 gloo ranks must train
like eager DDP under bucketwise; the check must catch a wrong gradient; docs/models.md must be
what the committed results generate.

Models whose library is missing, or installed but not importable (a torchvision wheel built for
another torch), are skipped with the import error as the reason.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.dist import run_distributed

from bucketwise.benchmarks.zoo.check import compare
from bucketwise.benchmarks.zoo.procs import importable
from bucketwise.benchmarks.zoo.registry import SUBSETS, get
from bucketwise.benchmarks.zoo.run import worker

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"

CONFIGS = ("bw-auto", "bw-split")
"""``auto`` is ``fused`` wherever fused applies; ``fused`` is added where ``auto`` picks ``split``."""


def _needs(name: str) -> None:
    for package in get(name).needs:
        why = importable(package)
        if why is not None:
            pytest.skip(f"{name} needs {package}: import {package} failed: {why}")


def _configs(name: str) -> tuple[str, ...]:
    return (*CONFIGS, "bw-fused") if get(name).find_unused_parameters else CONFIGS


def _run(tmp_path: Path, name: str, **opts) -> list[dict]:
    opts = {"mode": "check", "device": "cpu", "backend": "aot_eager", "steps": 3, "configs": _configs(name), **opts}
    return run_distributed(worker, tmp_path, args=(name, opts), timeout=300)


@pytest.mark.parametrize("name", SUBSETS["ci"])
def test_zoo_model_trains_like_eager_ddp(tmp_path, name):
    _needs(name)
    for rank in _run(tmp_path, name):
        configs = {c["config"]: c for c in rank["configs"]}
        assert list(configs) == ["eager", *_configs(name)]
        for config in _configs(name):
            rec = configs[config]
            assert rec["status"] == "pass", f"rank {rank['rank']} {name} {config}: {json.dumps(rec, indent=1)[:3000]}"
            assert rec["fallbacks"] == 0 and rec["replica_spread"] == 0.0
        if get(name).find_unused_parameters:
            # DDP keeps its construction-time buckets, the first of them 1 MiB: one bucket here
            assert configs["bw-auto"]["strategies"] == ["split"]
        else:
            assert configs["bw-auto"]["strategies"] == ["fused"]
            split = configs["bw-split"]
            assert split["segments"] > split["graphs"], "the bucket cap should cut the graphs"


@pytest.mark.parametrize("name", ["llama", "llama-checkpointing-reentrant"])
def test_auto_with_shared_blocks_trains_like_eager_ddp(tmp_path, name):
    """``bw-auto-blocks`` (asked for by name): the decoder's layers share one compile and every
    parameter ends as eager DDP's. Under reentrant activation checkpointing the graph calling
    each block as one op does not compile: Dynamo traces the blocks again (transformers before
    5.25, which checkpoints each layer's ``__call__``) or runs the checkpointed layers eagerly as
    under ``torch.compile`` (5.25 on, which checkpoints ``forward``); the report says why."""
    for rank in _run(tmp_path, name, configs=("bw-auto-blocks",)):
        rec = rank["configs"][1]
        assert rec["config"] == "bw-auto-blocks" and rec["status"] == "pass", json.dumps(rec, indent=1)[:3000]
        assert rec["fallbacks"] == 0 and rec["replica_spread"] == 0.0, rec
        shared = [s for s in rec["shared_blocks"] if "class" in s]
        if name == "llama":
            assert len(shared) == 1, rec["shared_blocks"]
            assert shared[0]["class"] == "LlamaDecoderLayer" and shared[0]["compiles"] == 1, shared
        else:
            assert all(s["class"] == "LlamaDecoderLayer" for s in shared), shared
            why = [s.get("dynamo_calls") or s.get("reason") or "" for s in rec["shared_blocks"]]
            assert any("the graph calling each block as one op did not compile" in w for w in why), why


def test_a_wrong_gradient_is_caught(tmp_path):
    """One parameter's gradient 1% off on every rank (as a bug would leave it): a mismatch."""
    for rank in _run(tmp_path, "llama", configs=("bw-fused",), perturb="bw-fused"):
        rec = rank["configs"][1]
        assert rec["status"] == "mismatch", rec
        assert rec["check"]["ratio"] > 3.0, rec["check"]


def test_check_tolerance():
    init = {"param w": torch.zeros(100), "buffer n": torch.tensor(0)}
    eager = {"param w": torch.linspace(-1, 1, 100) * 1e-2, "buffer n": torch.tensor(3)}
    roundoff = {"param w": eager["param w"] * (1 + 1e-5), "buffer n": torch.tensor(3)}
    assert compare(init, eager, roundoff)["ok"]
    wrong = {"param w": eager["param w"].clone(), "buffer n": torch.tensor(3)}
    wrong["param w"][7] *= 1.01
    assert not compare(init, eager, wrong)["ok"]
    steps = {"param w": eager["param w"], "buffer n": torch.tensor(2)}
    assert compare(init, eager, steps)["worst"] == "buffer n"


def _table(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCH / "tables" / "zoo.py"), "--root", str(root), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _write_run(root: Path, folder: str, record: dict) -> Path:
    """``record`` as ``benchmarks/results/<folder>/zoo.json`` under ``root``; returns the folder."""
    path = root / "benchmarks" / "results" / folder
    path.mkdir(parents=True)
    (path / "zoo.json").write_text(json.dumps(record))
    return path


def _check_run(date: str, models: list, **header) -> dict:
    """A CPU check run's record as ``zoo.py`` writes it."""
    return {
        "type": "zoo",
        "mode": "check",
        "date": date,
        "machine": "CPU, 2 gloo ranks",
        "backend": "aot_eager",
        "steps": 3,
        "versions": {"torch": "2.99"},
        "models": models,
        **header,
    }


def _gpu_only(name: str) -> dict:
    """A model record of a CPU run that the model did not run in (GPU only)."""
    return {"model": name, "family": "case", "source": name, "status": "gpu only", "reason": "needs a GPU"}


def _render(root: Path) -> str:
    """docs/models.md as ``tables/zoo.py`` writes it from the runs under ``root``."""
    (root / "docs").mkdir(exist_ok=True)
    assert _table(root).returncode == 0
    return (root / "docs" / "models.md").read_text()


def test_models_doc_is_current():
    result = _table(ROOT, "--check")
    assert result.returncode == 0, result.stderr


def test_models_doc_counts_the_records(tmp_path):
    def model(name, statuses):
        configs = [{"config": "eager", "status": "pass", "params": 10}]
        configs += [
            {
                "config": c,
                "status": s,
                "check": {"ok": s == "pass", "ratio": 0.1, "rel_err": 1e-6, "worst": "w"},
                "replica_spread": 0.0,
                "error": "RuntimeError: boom",
            }
            for c, s in statuses.items()
        ]
        return {"model": name, "family": "transformers", "source": f"{name} class", "status": "ran", "configs": configs}

    run = _check_run(
        "2026-01-01T00:00:00+00:00",
        command="python3 -m bucketwise.benchmarks zoo",
        models=[
            model("a", {"torch": "pass", "auto": "pass", "fused": "pass", "split": "pass"}),
            model("b", {"torch": "error", "auto": "pass", "fused": "pass", "split": "error"}),
            model("c", {"torch": "pass", "auto": "mismatch", "fused": "mismatch", "split": "pass"}),
            _gpu_only("d"),
        ],
    )
    folder = _write_run(tmp_path, "2026-01-01_cpu_zoo", run)
    doc = _render(tmp_path)
    assert "| `torch.compile(DDP(model))` | 2 of 3 |" in doc
    assert '| bucketwise `strategy="auto"` | 2 of 3 |' in doc
    assert "bucketwise `auto` passes on 1; `auto` passes on 1 model(s) where it does not (b)" in doc
    assert "| `d` | d | - | GPU only | GPU only |" in doc
    assert "- `b`, `torch`: error: `RuntimeError: boom`" in doc
    assert "No one-GPU run is recorded yet" in doc
    assert _table(tmp_path, "--check").returncode == 0
    (folder / "zoo.json").write_text(json.dumps({**run, "steps": 4}))
    assert _table(tmp_path, "--check").returncode == 1

    speed = {
        **run,
        "mode": "speed",
        "machine": "1 x Fake GPU, NCCL",
        "backend": "inductor",
        "steps": 10,
        "models": [
            {
                "model": "a",
                "family": "transformers",
                "source": "a class",
                "status": "ran",
                "configs": [
                    {"config": "eager", "status": "pass", "median_ms": 3.0, "peak_mib": 30.0},
                    {"config": "local", "status": "pass", "median_ms": 1.5, "peak_mib": 20.4},
                    {"config": "bw-fused-cg", "status": "error", "error": "ValueError: no"},
                ],
            },
            {"model": "e", "family": "case", "source": "e", "status": "not run", "reason": "past the budget"},
        ],
    }
    _write_run(tmp_path, "2026-01-02_1xFake_zoo", speed)
    doc = _render(tmp_path)
    assert "| `a` | 3.00 / 30 | 1.50 / 20 | - | - | error |" in doc
    assert "| `e` | not run | not run |" in doc
    assert "- `a`, `bw-fused-cg`: error: `ValueError: no`" in doc
    assert "- `e`: not run: past the budget" in doc


def test_models_doc_takes_each_model_from_its_newest_run(tmp_path):
    """A run of a few models (``zoo.py --models``) updates those rows only; the page names both
    runs and the backend of a model run with another one."""

    def model(name, status, **extra):
        configs = [{"config": "eager", "status": "pass", "params": 10}]
        configs += [
            {"config": c, "status": status, "check": {"ok": status == "pass", "rel_err": 1e-6}}
            for c in ("torch", "auto", "fused", "split")
        ]
        return {"model": name, "family": "case", "source": name, "status": "ran", "configs": configs, **extra}

    gpu_only = _gpu_only("c")
    full = [model("a", "pass"), model("b", "mismatch"), model("d", "pass"), gpu_only]
    part = [model("b", "pass", backend="inductor"), gpu_only]
    _write_run(tmp_path, "2026-01-01_cpu_zoo", _check_run("2026-01-01T00:00:00+00:00", full))
    _write_run(tmp_path, "2026-01-02_cpu_zoo-cases", _check_run("2026-01-02T00:00:00+00:00", part))
    doc = _render(tmp_path)
    assert '| bucketwise `strategy="auto"` | 3 of 3 |' in doc
    assert "[CPU run](../benchmarks/results/2026-01-01_cpu_zoo/): CPU" in doc
    assert "[CPU run](../benchmarks/results/2026-01-02_cpu_zoo-cases/) for `b`, `c`: CPU" in doc
    assert "backend `inductor`, 3 SGD steps, 2026-01-02." in doc
    assert "| `b` | b; backend `inductor` | 10 | pass | pass |" in doc
    assert doc.index("| `a` |") < doc.index("| `b` |") < doc.index("| `d` |") < doc.index("| `c` |")  # first seen


def test_models_doc_takes_each_gpu_timing_from_its_newest_run(tmp_path):
    """A GPU run of a few models updates their rows of the speed table only; the page names both
    runs, which models the smaller one gives, and labels each run's notes with its folder."""

    def timed(name, ms):
        configs = [{"config": c, "status": "pass", "median_ms": ms, "peak_mib": 10.0} for c in ("eager", "local")]
        return {"model": name, "family": "case", "source": name, "status": "ran", "configs": configs}

    def speed_run(date, models, notes):
        return _check_run(date, models, mode="speed", machine="1 x Fake GPU, NCCL", backend="inductor", notes=notes)

    checks = [_gpu_only(n) for n in "abc"]
    _write_run(tmp_path, "2026-01-01_cpu_zoo", _check_run("2026-01-01T00:00:00+00:00", checks))
    first = [timed("a", 1.0), {"model": "b", "family": "case", "source": "b", "status": "not run", "reason": "budget"}]
    _write_run(tmp_path, "2026-01-02_1xFake_zoo", speed_run("2026-01-02T00:00:00+00:00", first, ["b ran out of time"]))
    _write_run(tmp_path, "2026-01-03_1xFake_zoo-b", speed_run("2026-01-03T00:00:00+00:00", [timed("b", 2.0)], []))
    doc = _render(tmp_path)
    assert "[GPU run](../benchmarks/results/2026-01-02_1xFake_zoo/): 1 x Fake GPU" in doc
    assert "[GPU run](../benchmarks/results/2026-01-03_1xFake_zoo-b/) for `b`: 1 x Fake GPU" in doc
    assert "| `a` | 1.00 / 10 | 1.00 / 10 | - | - | - |" in doc
    assert "| `b` | 2.00 / 10 | 2.00 / 10 | - | - | - |" in doc
    assert "not run" not in doc.split("## Step time")[1]
    assert "- `2026-01-02_1xFake_zoo`: b ran out of time" in doc
    assert "Not in any GPU run: `c` (GPU-only cases)" in doc


def test_cases_about_inductor_run_with_it_on_cpu(monkeypatch, tmp_path):
    """A case that exists to exercise Inductor (max-autotune) runs with it on CPU unless
    ``--backend`` is given; the record names the backend where it differs from the run's."""
    from bucketwise.benchmarks.zoo import main as zoo

    seen = []

    def run_ranks(name, opts, **kw):
        seen.append(opts["backend"])
        return {"status": "ran", "configs": []}

    monkeypatch.setattr(zoo, "run_ranks", run_ranks)
    model = get("llama-max-autotune")
    _needs(model.name)
    rec = zoo.run_one(model, zoo.parse(["--out", str(tmp_path)]), tmp_path, timeout_s=1.0)
    assert seen == ["inductor"] and rec["backend"] == "inductor", (seen, rec)
    rec = zoo.run_one(model, zoo.parse(["--out", str(tmp_path), "--backend", "eager"]), tmp_path, timeout_s=1.0)
    assert seen[-1] == "eager" and "backend" not in rec, (seen, rec)
    assert (
        zoo.run_one(get("llama-flex-attention"), zoo.parse(["--out", str(tmp_path)]), tmp_path, timeout_s=1.0)["status"]
        == "gpu only"
    )


def test_a_model_cut_short_by_the_run_budget_is_not_run(monkeypatch, tmp_path):
    """The run's ``--budget-s``, not the model, stopped it: recorded as not run, with the fix."""
    from bucketwise.benchmarks.zoo import main as zoo

    calls = []

    def run_ranks(name, opts, *, timeout_s, **kw):
        calls.append(timeout_s)
        return {"model": name, "status": "error", "reason": f"timed out after {timeout_s:g} s", "timed_out": True}

    monkeypatch.setattr(zoo, "run_ranks", run_ranks)
    model = get("llama")
    _needs(model.name)
    assert zoo.main(["--models", "llama", "--budget-s", "100", "--timeout-s", "900", "--out", str(tmp_path)]) == 0
    rec = json.loads((tmp_path / "zoo.json").read_text())["models"][0]
    assert calls and calls[0] <= 100, calls
    assert rec["status"] == "not run" and "--budget-s of 100 s ran out" in rec["reason"], rec
    assert "--models llama" in rec["reason"] and "timed_out" not in rec, rec
    # its own --timeout-s, well inside the budget: an error of the model
    assert zoo.main(["--models", "llama", "--budget-s", "1000", "--timeout-s", "60", "--out", str(tmp_path)]) == 0
    rec = json.loads((tmp_path / "zoo.json").read_text())["models"][0]
    assert rec["status"] == "error" and rec["reason"] == "timed out after 60 s", rec


def test_models_doc_says_when_the_gpu_check_cannot_judge_a_model(tmp_path):
    """A step-checked GPU run: a mismatch names the step and tensor; where ``local`` (Inductor
    without DDP) fails too, the page says the GPU check cannot judge that model."""

    def rec(config, ratio):
        exact = {"ok": ratio <= 1, "worst": "param v", "ratio": 2 * ratio, "rel_err": ratio / 50}
        step = {"ok": ratio <= 1, "worst": "param w", "ratio": ratio, "rel_err": ratio / 100, "step": 14, "fp64": exact}
        status = "pass" if ratio <= 1 else "mismatch"
        return {"config": config, "status": status, "median_ms": 1.0, "peak_mib": 1.0, "step_check": step}

    eager = {"config": "eager", "status": "pass", "median_ms": 2.0, "peak_mib": 1.0}
    models = [
        {
            "model": m,
            "family": "case",
            "source": m,
            "status": "ran",
            "configs": [eager, rec("local", lr), rec("bw-fused", br)],
        }
        for m, lr, br in (("ok", 0.5, 3.0), ("noisy", 2.5, 4.0))
    ]
    run = _check_run(
        "2026-01-02T00:00:00+00:00", models, mode="speed", machine="1 x Fake GPU, NCCL", backend="inductor"
    )
    _write_run(tmp_path, "2026-01-01_cpu_zoo", _check_run("2026-01-01T00:00:00+00:00", [_gpu_only("ok")]))
    _write_run(tmp_path, "2026-01-02_1xFake_zoo", {**run, "conv_tf32": False})
    doc = _render(tmp_path)
    assert "checked step by step against fp32 and float64 twins, convolutions in fp32" in doc
    assert "| `ok` | 2.00 / 1 | 1.00 / 1 | - | 1.00 / 1 (mismatch) | - |" in doc
    assert (
        "`ok`, `bw-fused`: one step's update differs from the eager twin's: worst tensor `param w`, error 3 x "
        "the tolerance, and 6 x its yardstick against the float64 twin (`param v`) (step 14)"
    ) in doc
    assert "`noisy`: `local` (the model compiled without DDP or bucketwise) fails the check too, at 2.5 x" in doc
    assert "`ok`: `local`" not in doc


def test_the_gpu_step_check_catches_a_wrong_gradient(tmp_path):
    """NOTE [checking a config step by step], on CPU ranks: a config whose gradient is 5% off
    fails against its eager twin; an unperturbed config passes."""
    _needs("llama")
    opts = {"mode": "speed", "device": "cpu", "backend": "aot_eager", "steps": 1, "configs": ("local", "bw-fused")}
    for rank in run_distributed(worker, tmp_path, args=("llama", {**opts, "perturb": "bw-fused"}), timeout=300):
        configs = {c["config"]: c for c in rank["configs"]}
        assert configs["local"]["status"] == "pass", configs["local"]
        assert configs["bw-fused"]["status"] == "mismatch", configs["bw-fused"]
        assert configs["bw-fused"]["step_check"]["ratio"] > 3.0, configs["bw-fused"]["step_check"]
        assert configs["bw-fused"]["step_check"]["fp64"]["ratio"] > 3.0, configs["bw-fused"]["step_check"]


def test_the_float64_yardstick():
    """``against_fp64``: a config as far from the float64 update as eager fp32 is (round-off)
    passes even where that is most of the update; a gradient 5% off does not."""
    from bucketwise.benchmarks.zoo.check import against_fp64

    g = torch.Generator().manual_seed(0)
    init = {"param w": torch.zeros(1000), "buffer n": torch.tensor(3)}
    exact = {"param w": torch.randn(1000, generator=g, dtype=torch.float64), "buffer n": torch.tensor(4)}

    def noise():  # round-off as large as half the update
        return 0.5 * torch.randn(1000, generator=g)

    eager = {"param w": exact["param w"].float() + noise(), "buffer n": torch.tensor(4)}
    assert against_fp64(
        init, eager, {"param w": exact["param w"].float() + noise(), "buffer n": torch.tensor(4)}, exact
    )["ok"]
    off = {"param w": exact["param w"].float() * 1.05, "buffer n": torch.tensor(4)}
    assert not against_fp64(init, {**off, "param w": exact["param w"].float()}, off, exact)["ok"]
    assert not against_fp64(init, eager, {**eager, "buffer n": torch.tensor(5)}, exact)["ok"]
