"""``benchmarks/tables/perf.py``: the docs' performance tables are the records of
``benchmarks/results/``, and the committed docs are current."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "tables" / "perf.py"
CELL = re.compile(r"^(?P<ms>\d+\.\d\d)(?: \((?P<ratio>\d+\.\d\d)x(?P<ro> ro)?\))?$")


def _perf_tables(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(root), *args], capture_output=True, text=True, timeout=60
    )


def _meta(
    date: str, *, world: int = 2, model: str = "gpt", net: str = "default", cap=None, steps: int = 20, env=None
) -> dict:
    return {
        "type": "meta",
        "date": f"{date}T10:00:00+00:00",
        "command": f"python3 -m bucketwise.benchmarks ddp --model {model}",
        "device_name": "Fake GPU",
        "world_size": world,
        "torch": "2.99.0",
        "net": net,
        "bucket_cap_mb": cap,
        "steps": steps,
        "model": {"model": model, "params": 1234},
        "allreduce_probe": {"median_ms": 1.5},
        "env": env or {"NCCL_MAX_CTAS": None},
    }


def _row(config: str, ms: float, floor: str | None = "local", ratio: float | None = None, status: str = "ok") -> dict:
    if status != "ok":
        return {"type": "result", "config": config, "status": status}
    return {
        "type": "result",
        "config": config,
        "status": "ok",
        "median_ms": ms,
        "floor_config": floor,
        "floor_ratio": ratio,
    }


def _write_run(folder: Path, meta: dict, rows: list[dict]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.jsonl").write_text("".join(json.dumps(o) + "\n" for o in (meta, *rows)))


def _fake_repo(root: Path) -> dict[str, list[tuple[dict, list[dict]]]]:
    """A repository with README.md, docs/performance.md and six results folders; returns the
    records of each folder (one entry per run, in run order)."""
    (root / "docs").mkdir(parents=True)
    (root / "README.md").write_text(
        "# fake\n\n<!-- perf-current:begin -->\nold\n<!-- perf-current:end -->\n\n"
        "<!-- perf-first-step:begin -->\nold\n<!-- perf-first-step:end -->\n\nend\n"
    )
    (root / "docs" / "performance.md").write_text(
        "# perf\n\n<!-- perf-tax:begin -->\n<!-- perf-tax:end -->\n\n"
        "<!-- perf-tables:begin -->\n<!-- perf-tables:end -->\n"
    )
    results = root / "benchmarks" / "results"
    folders = {
        # the newest main folder: 2 ranks, default net, default cap, ran local and the default (bw-auto)
        "2026-01-02_2xFake_gpt-nvlink": [
            (
                _meta("2026-01-02"),
                [
                    _row("local", 10.0, ratio=1.0),
                    _row("torch", 20.004, ratio=2.0004),
                    _row("bw-fused", 11.0, ratio=1.1),
                    _row("bw-auto", 11.0, ratio=1.1),
                    _row("local#2", 10.5, ratio=1.05),
                ],
            ),
            (
                _meta("2026-01-02", steps=40),
                [_row("local", 12.0, ratio=1.0), _row("bw-fused", 13.2, ratio=1.1), _row("torch", 0, status="error")],
            ),
        ],
        "2026-01-01_2xFake_gpt-nvlink": [
            (_meta("2026-01-01"), [_row("local", 9.0, ratio=1.0), _row("torch", 18.0, ratio=2.0)])
        ],
        "2026-01-03_2xFake_gpt-socket": [
            (
                _meta("2026-01-03", net="socket"),
                [_row("eager", 200.0, None), _row("local", 9.5, ratio=1.0), _row("torch", 300.0, ratio=31.57)],
            )
        ],
        "2026-01-04_2xFake_gpt-sweep": [
            (_meta("2026-01-04", cap=5.0), [_row("local", 9.0, ratio=1.0), _row("torch", 9.9, ratio=1.1)])
        ],
        # newer and with local and bw-auto, but NCCL's CTAs capped: a lever, not the README's table
        "2026-01-05_2xFake_gpt-max-ctas": [
            (
                _meta("2026-01-05", env={"NCCL_MAX_CTAS": "8"}),
                [_row("local", 9.0, ratio=1.0), _row("bw-auto", 9.9, ratio=1.1)],
            )
        ],
        "2026-01-02_4xFake_gpt-tiny": [
            (
                _meta("2026-01-02", world=4, model="gpt-tiny"),
                [_row("local-ro", 3.0, "local-ro", 1.0), _row("bw-fused-cg", 3.3, "local-ro", 1.1)],
            )
        ],
        # older, but the only 4-rank folder with local and bw-auto: the README's 4-rank table
        "2026-01-01_4xFake_gpt-medium": [
            (
                _meta("2026-01-01", world=4, model="gpt-medium"),
                [_row("local", 20.0, ratio=1.0), _row("bw-auto", 21.0, ratio=1.05)],
            )
        ],
    }
    for name, runs in folders.items():
        for i, (meta, rows) in enumerate(runs):
            folder = results / name / f"run-{i + 1}" if len(runs) > 1 else results / name
            _write_run(folder, meta, rows)
        (results / name / "README.md").write_text(f"# title of {name}\n\nwhat ran\n")
    return folders


def _tables(text: str) -> dict[str, list[list[str]]]:
    """folder name -> table rows (cells) of the generated section."""
    tables: dict[str, list[list[str]]] = {}
    current = None
    for line in text.splitlines():
        link = re.match(r"^\[title of (?P<name>[^\]]+)\]\(", line)
        if link:
            current = tables.setdefault(link["name"], [])
        elif (
            current is not None
            and line.startswith("| ")
            and not line.startswith("| config")
            and not line.startswith("| ---")
        ):
            current.append([c.strip() for c in line.strip("|").split("|")])
    return tables


def _check_cell(cell: str, row: dict | None) -> None:
    if row is None:
        assert cell == "-", cell
        return
    if row["status"] != "ok":
        assert cell == row["status"], (cell, row)
        return
    m = CELL.match(cell)
    assert m, f"expected 'ms (ratio x)', got {cell!r}"
    assert float(m["ms"]) == round(row["median_ms"], 2)
    assert (m["ratio"] is None) == (row["floor_ratio"] is None)
    if m["ratio"] is not None:
        assert float(m["ratio"]) == round(row["floor_ratio"], 2)
    assert bool(m["ro"]) == (row["floor_config"] == "local-ro")


def test_tables_are_the_records(tmp_path):
    folders = _fake_repo(tmp_path)
    result = _perf_tables(tmp_path)
    assert result.returncode == 0, result.stderr
    perf = (tmp_path / "docs" / "performance.md").read_text()
    section = perf.split("<!-- perf-tables:begin -->")[1].split("<!-- perf-tables:end -->")[0]
    tables = _tables(section)
    assert set(tables) == set(folders)
    for name, runs in folders.items():
        rows = tables[name]
        configs = [r[0].strip("`") for r in rows[:-1]]
        seen = {row["config"] for _, records in runs for row in records}
        assert sorted(configs) == sorted(seen), name
        if "local#2" in configs:  # a repeat right after its config
            assert configs.index("local#2") == configs.index("local") + 1
        for cells in rows[:-1]:
            config = cells[0].strip("`")
            assert len(cells) == 1 + len(runs)
            for cell, (_, records) in zip(cells[1:], runs):
                _check_cell(cell, next((r for r in records if r["config"] == config), None))
        assert rows[-1] == ["all-gradient allreduce"] + ["1.50"] * len(runs)
    # Grouped by hardware (fewest ranks first), then date (newest first).
    headings = re.findall(r"^#{3,4} .*$", section, re.M)
    assert headings == [
        "### 2 x Fake GPU",
        "#### 2 x Fake GPU, 2026-01-05",
        "#### 2 x Fake GPU, 2026-01-04",
        "#### 2 x Fake GPU, 2026-01-03",
        "#### 2 x Fake GPU, 2026-01-02",
        "#### 2 x Fake GPU, 2026-01-01",
        "### 4 x Fake GPU",
        "#### 4 x Fake GPU, 2026-01-02",
        "#### 4 x Fake GPU, 2026-01-01",
    ]
    caption = next(line for line in section.splitlines() if "title of 2026-01-02_2xFake_gpt-nvlink" in line)
    assert "(../benchmarks/results/2026-01-02_2xFake_gpt-nvlink/)" in caption
    assert "2 x Fake GPU, torch 2.99.0, model `gpt` (1,234 parameters)" in caption and "20/40 timed steps" in caption
    # README: per world size (2, then 4), the newest folder on the default net, bucket cap and
    # NCCL that ran local and bw-auto.
    readme = (tmp_path / "README.md").read_text()
    current = readme.split("<!-- perf-current:begin -->")[1].split("<!-- perf-current:end -->")[0]
    assert list(_tables(current)) == ["2026-01-02_2xFake_gpt-nvlink", "2026-01-01_4xFake_gpt-medium"]
    assert _tables(current)["2026-01-01_4xFake_gpt-medium"][-2:] == [
        ["`bw-auto`", "21.00 (1.05x)"],
        ["all-gradient allreduce", "1.50"],
    ]
    assert (
        "(https://github.com/bucketwise/bucketwise/tree/main/benchmarks/results/2026-01-02_2xFake_gpt-nvlink/)"
        in current
    )
    assert readme.startswith("# fake\n") and readme.endswith("<!-- perf-first-step:end -->\n\nend\n")
    first_step = readme.split("<!-- perf-first-step:begin -->")[1].split("<!-- perf-first-step:end -->")[0]
    assert first_step.strip() == "No first-step runs with torch's bytecode cached yet."


def test_check_fails_when_a_record_changes(tmp_path):
    _fake_repo(tmp_path)
    assert _perf_tables(tmp_path).returncode == 0
    check = _perf_tables(tmp_path, "--check")
    assert check.returncode == 0, check.stderr
    run = tmp_path / "benchmarks" / "results" / "2026-01-02_4xFake_gpt-tiny" / "results.jsonl"
    run.write_text(run.read_text().replace('"median_ms": 3.3', '"median_ms": 3.4'))
    before = (tmp_path / "docs" / "performance.md").read_text()
    check = _perf_tables(tmp_path, "--check")
    assert check.returncode == 1
    assert "performance.md" in check.stderr and "README.md" not in check.stderr
    assert (tmp_path / "docs" / "performance.md").read_text() == before  # --check writes nothing
    assert _perf_tables(tmp_path).returncode == 0
    assert "| `bw-fused-cg` | 3.40 (1.10x ro) |" in (tmp_path / "docs" / "performance.md").read_text()


def test_runs_of_other_hardware_in_one_folder_are_an_error(tmp_path):
    _fake_repo(tmp_path)
    folder = tmp_path / "benchmarks" / "results" / "2026-01-02_2xFake_gpt-nvlink" / "run-2"
    _write_run(folder, _meta("2026-01-02", world=4), [_row("local", 1.0, ratio=1.0)])
    result = _perf_tables(tmp_path, "--check")
    assert result.returncode != 0 and "differ in world_size" in result.stderr


def test_repository_docs_are_current():
    result = _perf_tables(ROOT, "--check")
    assert result.returncode == 0, result.stderr


def test_every_results_folder_says_what_ran():
    """Each folder has a README whose first line is a title, and names every run's exact command."""
    results = ROOT / "benchmarks" / "results"
    for folder in sorted(p for p in results.iterdir() if p.is_dir()):
        readme = folder / "README.md"
        assert readme.exists(), f"{folder} has no README.md"
        text = readme.read_text()
        assert text.startswith("# "), f"{readme} must start with a '# title' line"
        for run in folder.rglob("results.jsonl"):
            command = json.loads(run.read_text().splitlines()[0])["command"]
            assert command in text, f"{readme} does not give the command of {run}: {shlex.quote(command)}"


def _restarts(
    folder: Path, run: str, *, date: str, model: str, configs: dict, bytecode: str | None, layers: int = 32
) -> None:
    meta = {
        "date": f"{date}T10:00:00+00:00",
        "gpu": "Fake GPU",
        "device": "cuda",
        "torch": "2.99.0",
        "world_size": 1,
        "pairs": 0,
        "model": model,
        "sizes": {"layers": layers},
    }
    if bytecode is not None:
        meta["python_bytecode"] = bytecode
    summary = {c: {"cold_s": cold, "warm_s": warm, "fresh_over_warm": None} for c, (cold, warm) in configs.items()}
    (folder / run).mkdir(parents=True)
    (folder / run / "results.json").write_text(
        json.dumps({"meta": meta, "rows": [], "restarts": {"rounds": 1, "summary": summary, "runs": {}}})
    )


def test_first_step_table_keeps_the_newest_run_with_bytecode_cached(tmp_path):
    """Per model and config the newest restart run whose Python ran torch from cached bytecode;
    runs without it, or that did not record it, are left out (NOTE [compiled bytecode])."""
    from bucketwise.benchmarks.tables.perf import first_step_table

    results = tmp_path / "results"
    recompiled = "compiled from source in every process"
    runs = [  # folder (named by its date), configs (cold, warm s), what the run recorded of the bytecode
        ("2026-01-01", {"regional": (9.0, 4.0), "bw-fused-blocks": (20.0, 6.0)}, "cached"),
        ("2026-01-02", {"regional": (8.0, 3.0)}, "cached"),
        ("2026-01-03", {"regional": (30.0, 9.0)}, recompiled),
        ("2026-01-04", {"local": (80.0, 7.0)}, None),
    ]
    for (date, configs, bytecode), letter in zip(runs, "abcd"):
        _restarts(results / f"{date}_{letter}", "r", date=date, model="llama", configs=configs, bytecode=bytecode)
    rows = [line for line in first_step_table(results, "L/").splitlines() if line.startswith("| llama")]
    gpu = "Fake GPU, 2.99.0"
    assert rows == [
        f"| llama, 32 layers | `regional` | 8.00 | 3.00 | - | {gpu} | [2026-01-02_b](L/2026-01-02_b/) |",
        f"| llama, 32 layers | `bw-fused-blocks` | 20.00 | 6.00 | - | {gpu} | [2026-01-01_a](L/2026-01-01_a/) |",
    ]


def test_first_step_table_orders_models_by_depth_then_config(tmp_path):
    from bucketwise.benchmarks.tables.perf import first_step_table

    results = tmp_path / "results"
    for layers in (32, 8, 16):
        configs = {"bw-fused-blocks": (float(layers), 1.0), "regional": (1.0, 1.0)}
        _restarts(
            results / f"2026-01-01_l{layers}",
            "r",
            date="2026-01-01",
            model="llama",
            configs=configs,
            bytecode="cached",
            layers=layers,
        )
    rows = [
        line.split(" | ")[:2] for line in first_step_table(results, "L/").splitlines() if line.startswith("| llama")
    ]
    assert rows == [[f"| llama, {n} layers", f"`{c}`"] for n in (8, 16, 32) for c in ("regional", "bw-fused-blocks")], (
        rows
    )


def test_a_run_of_several_rounds_shows_its_worst_round_and_spread(tmp_path):
    """``ddp --rounds``: the cell is the median over rounds and its ratio, then the largest
    per-round ratio and the spread of the round medians; the caption says the rounds, and the
    probe row is the median of the per-round probes."""
    _fake_repo(tmp_path)
    meta = _meta("2026-01-05", steps=30)
    meta.update(rounds=3, allreduce_probe_rounds=[{"median_ms": m} for m in (1.0, 3.0, 2.5)])
    local = {**_row("local", 10.0, ratio=1.0), "round_spread": {"min_ms": 9.5, "max_ms": 10.5, "pct": 10.0}}
    local["max_round_floor_ratio"] = 1.0
    fused = {**_row("bw-fused", 11.0, ratio=1.1), "round_spread": {"min_ms": 10.0, "max_ms": 12.0, "pct": 18.18}}
    fused["max_round_floor_ratio"] = 1.2
    eager = {**_row("eager", 30.0, floor=None), "round_spread": {"min_ms": 29.0, "max_ms": 31.0, "pct": 6.67}}
    _write_run(tmp_path / "benchmarks" / "results" / "2026-01-05_2xFake_gpt-rounds", meta, [local, fused, eager])
    (tmp_path / "benchmarks" / "results" / "2026-01-05_2xFake_gpt-rounds" / "README.md").write_text("# rounds\n")
    result = _perf_tables(tmp_path)
    assert result.returncode == 0, result.stderr
    perf = (tmp_path / "docs" / "performance.md").read_text()
    caption = next(line for line in perf.splitlines() if line.startswith("[rounds]"))
    assert "30 timed steps, 3 interleaved rounds (medians over rounds)" in caption
    assert "| `bw-fused` | 11.00 (1.10x; max round 1.20x, spread 18.2%) |" in perf
    assert "| `local` | 10.00 (1.00x; max round 1.00x, spread 10.0%) |" in perf
    assert "| `eager` | 30.00 (spread 6.7%) |" in perf
    section = perf.split("[rounds]")[1]
    assert "| all-gradient allreduce | 2.50 |" in section
