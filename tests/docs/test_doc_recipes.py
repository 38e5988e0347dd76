"""The scripts the docs show (docs/recipes/, included verbatim in the pages: NOTE [docs include
their scripts] in tests/docs/doc_includes.py), run as they are, launched the way the docs say, on 2 CPU
ranks (the recipes' device switch picks CPU ranks on a machine without GPUs).

Each framework recipe also runs without bucketwise: the same file with its one bucketwise line
replaced (each replacement must match exactly once, so the eager run cannot silently be the
bucketwise one). Both must end with the same parameters and losses (the Trainer's gradient norms
too), and bucketwise's per-rank stats must name the strategy that ran. The recipes compile with
the default inner backend, Inductor, whose fused kernels round differently from eager: the
tolerances are Inductor's, not aot_eager's exact ones.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.entry_point import entry_point_dir

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "docs" / "recipes"
TIMEOUT_S = 900
TOL = {"rtol": 1e-4, "atol": 1e-5}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def _env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            # the entry points pyproject.toml declares, and this checkout, for every rank
            "PYTHONPATH": os.pathsep.join([str(entry_point_dir(tmp))] + [p for p in sys.path if p]),
            "BUCKETWISE_STATS_DIR": str(tmp / "stats"),
            "BUCKETWISE_PROGRESS": "0",
            "HF_HUB_OFFLINE": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "OMP_NUM_THREADS": "1",
            "TORCHINDUCTOR_COMPILE_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    return env


def _run(launcher: list[str], script: Path, cwd: Path) -> str:
    cwd.mkdir(parents=True, exist_ok=True)
    cmd = launcher + [str(script)]
    proc = subprocess.run(cmd, env=_env(cwd), cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    )
    return proc.stdout


def without_bucketwise(name: str, swaps: list[tuple[str, str]], tmp: Path) -> Path:
    """The recipe with each ``old`` replaced by ``new``; each must occur exactly once."""
    text = (RECIPES / name).read_text()
    for old, new in swaps:
        assert text.count(old) == 1, f"{name}: expected {old!r} once, found it {text.count(old)} times"
        text = text.replace(old, new)
    code = re.sub(r"#.*", "", text)  # comments may still name it
    uses = re.findall(r"^\s*(?:import|from) bucketwise.*|bucketwise\.\w+|\"bucketwise\"|Bucketwise\w*", code, re.M)
    assert not uses, f"{name}: the eager variant still uses bucketwise: {uses}"
    path = tmp / "eager" / name
    path.parent.mkdir(parents=True)
    path.write_text(text)
    return path


def run_pair(launcher: list[str], name: str, swaps: list[tuple[str, str]], tmp: Path) -> tuple[Path, str, Path, str]:
    """(folder, stdout) of the recipe as it is, then of its eager variant."""
    eager_script = without_bucketwise(name, swaps, tmp)
    out = _run(launcher, RECIPES / name, tmp / "bucketwise")
    eager_out = _run(launcher, eager_script, tmp / "eager")
    return tmp / "bucketwise", out, tmp / "eager", eager_out


def printed_losses(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"^step \d+: loss ([-\d.]+)$", stdout, re.M)]


def rank_stats(folder: Path, ranks: int = 2) -> list[dict]:
    return [json.loads((folder / "stats" / f"rank{r}.json").read_text()) for r in range(ranks)]


def training_strategies(stats: dict) -> list[str]:
    return [g["strategy"] for g in stats["graphs"] if g.get("variant") is None]


def assert_same_params(compiled: dict, eager: dict, strip: str = "") -> None:
    compiled = {k.replace(strip, ""): v for k, v in compiled.items()} if strip else compiled
    assert compiled.keys() == eager.keys(), (sorted(compiled), sorted(eager))
    for name, p in eager.items():
        torch.testing.assert_close(compiled[name].float(), p.float(), **TOL, msg=lambda m: f"{name}: {m}")


def assert_same_losses(compiled: list[float], eager: list[float], steps: int = 4) -> None:
    assert len(eager) == steps, eager
    torch.testing.assert_close(compiled, eager, **TOL)


# -- the recipes ---------------------------------------------------------------------------


@pytest.mark.inductor
def test_hf_trainer_recipe_runs_fused_and_trains_like_the_trainer(tmp_path):
    pytest.importorskip("transformers")
    from safetensors.torch import load_file

    run, out, eager, _ = run_pair(
        TORCHRUN,
        "hf_trainer.py",
        [
            ("from bucketwise.hf import BucketwiseTrainer\n", "from transformers import Trainer\n"),
            ("import bucketwise\n", ""),
            ("trainer = BucketwiseTrainer(", "trainer = Trainer("),
            ("        print(bucketwise.report(trainer.model).table())\n", "        pass\n"),
        ],
        tmp_path,
    )
    assert_same_params(
        load_file(run / "hf-out" / "model.safetensors"), load_file(eager / "hf-out" / "model.safetensors")
    )
    logs = [json.loads((d / "hf-out" / "trainer_state.json").read_text())["log_history"] for d in (run, eager)]
    for key in ("loss", "grad_norm"):  # grad_norm: the reduced gradient, before clipping
        assert_same_losses(*[[h[key] for h in log if key in h] for log in logs])
    for stats in rank_stats(run):
        # fused from the first step on: no uncompiled first call, one no_sync() variant for the
        # gradient-accumulation micro-steps
        assert training_strategies(stats) == ["fused"], stats["graphs"]
        assert [g["variant"] for g in stats["graphs"] if g["variant"]] == ["no_sync"]
        assert stats["totals"]["eager_calls"] == 0, stats["eager_calls"]
        assert any("BucketwiseTrainer" in n for n in stats["notes"]), stats["notes"]
    assert "alignment n/a (fused" in out


@pytest.mark.inductor
def test_accelerate_recipe_runs_fused_and_trains_like_eager(tmp_path):
    pytest.importorskip("accelerate")
    from safetensors.torch import load_file

    launcher = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
    ]
    run, out, eager, eager_out = run_pair(
        launcher,
        "accelerate_loop.py",
        [
            ("import bucketwise\n", ""),
            ('    model = torch.compile(model, backend="bucketwise")', "    pass"),
            ("    accelerator.print(bucketwise.report(model).table())\n", ""),
        ],
        tmp_path,
    )
    assert_same_params(
        load_file(run / "accelerate-out" / "model.safetensors"),
        load_file(eager / "accelerate-out" / "model.safetensors"),
    )
    assert_same_losses(printed_losses(out), printed_losses(eager_out))
    for stats in rank_stats(run):
        assert training_strategies(stats) == ["fused"], stats["graphs"]


@pytest.mark.inductor
def test_fabric_recipe_runs_fused_and_trains_like_eager(tmp_path):
    pytest.importorskip("lightning")
    run, out, eager, eager_out = run_pair(
        [sys.executable],
        "fabric_loop.py",
        [
            ("import bucketwise\n", ""),
            ('    model = torch.compile(Net(), backend="bucketwise")', "    model = Net()"),
            ("    fabric.print(bucketwise.report(model).table())\n", ""),
        ],
        tmp_path,
    )
    load = lambda d: torch.load(d / "fabric-out.ckpt", weights_only=True)["model"]  # noqa: E731
    assert_same_params(load(run), load(eager))
    assert_same_losses(printed_losses(out), printed_losses(eager_out))
    for stats in rank_stats(run):
        assert training_strategies(stats) == ["fused"], stats["graphs"]
    assert "alignment n/a (fused" in out  # report() of what torch.compile returned


@pytest.mark.inductor
def test_lightning_trainer_recipe_runs_split_and_trains_like_eager(tmp_path):
    pytest.importorskip("lightning")
    run, out, eager, eager_out = run_pair(
        [sys.executable],
        "lightning_trainer.py",
        [
            ("import bucketwise\n", ""),
            ('        self.net = torch.compile(Net(), backend="bucketwise")', "        self.net = Net()"),
            ("        print(bucketwise.report(lit.net).table())\n", ""),
        ],
        tmp_path,
    )
    load = lambda d: torch.load(d / "lightning-out.pt", weights_only=True)  # noqa: E731
    assert_same_params(load(run), load(eager), strip="_orig_mod.")
    assert_same_losses(printed_losses(out), printed_losses(eager_out))
    for stats in rank_stats(run):
        assert training_strategies(stats) == ["split"], stats["graphs"]
        # the rank file is rewritten once the reducer's buckets are known
        assert stats["alignment"]["alignment"] == 1.0, stats["alignment"]


# -- the other runnable scripts --------------------------------------------------------------


@pytest.mark.inductor
def test_integrations_train_script_runs(tmp_path):
    out = _run(TORCHRUN, RECIPES / "train.py", tmp_path)
    losses = printed_losses(out)
    assert len(losses) == 10 and losses[-1] < losses[0], out
    assert (tmp_path / "model.pt").exists()
    assert [training_strategies(s) for s in rank_stats(tmp_path)] == [["fused"], ["fused"]]


def test_doctor_example_reports_the_failing_stage_as_the_page_shows(tmp_path):
    """docs/troubleshooting.md: the doctor, with a fault-injecting third stage, on the page's
    script, prints the page's lines (the output block's, paths apart)."""
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    shown = re.search(r"^```\n(bucketwise doctor: .*?)^```", page, re.M | re.S).group(1)
    command = re.search(r"^(BUCKETWISE_DOCTOR_LADDER=\S+) \\\n\s+bucketwise (doctor .*doctor_example\.py)$", page, re.M)
    ladder, args = command.group(1).split("=", 1)[1], command.group(2).split()
    assert args[-1] == "doctor_example.py", args
    env = {**_env(tmp_path), "BUCKETWISE_DOCTOR_LADDER": ladder}
    env.pop("BUCKETWISE_STATS_DIR")
    cmd = [sys.executable, "-m", "bucketwise.launch.cli", *args[:-1], str(RECIPES / args[-1])]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout.replace(f"{tmp_path}/", "")
    lines = [line for line in shown.splitlines() if line != "..."]
    assert len(lines) >= 3 and " 0 failing" not in lines[0], lines
    for line in lines:
        assert line in out.splitlines(), f"the page shows {line!r}; the doctor printed:\n{out}"


@pytest.mark.inductor
def test_per_sample_grads_prints_what_its_comments_say(tmp_path):
    """docs/programming-model.md's example: each print's output is the comment on its line."""
    script = RECIPES / "per_sample_grads.py"
    expected = re.findall(r"^print\(.*\)\s+# (.*)$", script.read_text(), re.M)
    assert len(expected) == 2, expected
    out = _run([sys.executable], script, tmp_path)
    assert out.splitlines()[-len(expected) :] == expected, out
