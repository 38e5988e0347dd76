"""``docs/models.md``, generated from the zoo's results (``benchmarks/results/*/zoo.json``).

    python3 -m bucketwise.benchmarks zoo-table            # rewrite docs/models.md
    python3 -m bucketwise.benchmarks zoo-table --check    # exit 1 if docs/models.md is not what this would write

The CPU runs (``zoo.py``, correctness against eager DDP) give the coverage table and the pass
counts; the one-GPU runs (``zoo.py --device cuda``), if any, give step time and peak memory. On
each side every model comes from the newest run that has it (a run of a few models,
``--models``, updates those models only; the page names every run it draws on). Everything else
on the page is fixed text below.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Callable

from bucketwise.benchmarks.core.names import ZOO_CHECK, ZOO_SPEED, canonical, strategy_of

DOC = "docs/models.md"
CHECK_CONFIGS = ZOO_CHECK
SPEED_CONFIGS = ("eager", *ZOO_SPEED)
FAMILIES = {
    "transformers": "Hugging Face transformers",
    "peft": "peft",
    "torchvision": "torchvision",
    "timm": "timm",
    "case": "Cases users report",
}

INTRO = """# Models: does it work on mine?

Real architectures, built from their libraries' own classes and configs (no downloads), each
trained for a few steps on 2 CPU ranks (gloo) under `bucketwise.compile(DDP(model))` with each
strategy, and under plain `torch.compile(DDP(model))` for comparison, from the same parameters
on the same batches as eager DDP. The models are small (hidden size 32, one or two layers,
32 x 32 images; torchvision's ResNet-50, EfficientNet-B0 and MobileNetV3 at their full size):
what is tested is that the architecture compiles and trains like eager DDP, not its speed.

**Equal to eager DDP** means, for every parameter and buffer on both ranks, the update after the
last step (final minus initial value) is within `1e-3` of the largest eager update of that tensor,
plus `1e-7` (fp32), and both ranks hold the same parameters; integer buffers must be equal. Round-off
from reducing in another order or through AOTAutograd stays below {worst} of an update in the
runs below (the `worst rel. error` column), and one gradient off by 1% is caught
(`tests/benchmarks/test_zoo.py` checks it): the tolerance sits between the two.

Cells: **pass** (equal, no fallback), **fallback** (some graph ran uncompiled; the reason is
below), **mismatch** (not equal), **error** (raised; the message is below), **GPU only** (see the
note), **skipped** (a package was missing). Reproduce with `python3 -m bucketwise.benchmarks zoo --out DIR`
(`--help` for the options; [zoo/main.py](../benchmarks/zoo/main.py) says what it runs) after
`pip install -e '.[integrations,zoo]'` (install the torchvision build that matches your torch
first: pip may otherwise replace torch); this page is generated from the results by
`python3 -m bucketwise.benchmarks zoo-table`.
"""


GPU_COMMAND = "python3 -m bucketwise.benchmarks zoo --device cuda --out DIR"
NO_GPU_RUN = (
    f"No one-GPU run is recorded yet. `{GPU_COMMAND}` measures, on one GPU with Inductor, step time "
    "and peak memory of `local` (the model compiled without DDP), `torch`, `bw-fused` and `bw-fused-cg` "
    "for the models above that fit its time budget, and runs the GPU-only cases."
)


def worst_error(run: dict[str, Any]) -> str:
    """The largest relative error of a passing config, rounded up to one significant digit."""
    errs = [
        c["check"]["rel_err"]
        for m in run["models"]
        for c in m.get("configs", [])
        if c["status"] == "pass" and (c.get("check") or {}).get("rel_err") is not None
    ]
    if not errs:
        return "n/a"
    worst = max(errs)
    if worst == 0:
        return "`0`"
    exp = math.floor(math.log10(worst))
    mantissa = math.ceil(round(worst / 10**exp, 9))
    if mantissa == 10:
        mantissa, exp = 1, exp + 1
    return f"`{mantissa}e{exp}`"


def load(results: Path) -> list[tuple[str, dict[str, Any]]]:
    runs = []
    for path in sorted(results.glob("*/zoo.json")):
        run = json.loads(path.read_text())
        for model in run.get("models", []):
            for c in model.get("configs", []):
                c["config"] = canonical(c["config"])
        runs.append((path.parent.name, run))
    return runs


def merged(runs: list[tuple[str, dict[str, Any]]], mode: str) -> tuple[list[str], dict[str, Any]] | None:
    """The runs of ``mode`` (``check``: CPU, ``speed``: one GPU) as one: each model's record from
    the newest run that has it, in the order models first appear (oldest run first). Returns the
    runs drawn on, newest last, and the merged run (the newest run's header; each model carries
    ``run``, its folder's name)."""
    picked = sorted((r for r in runs if r[1].get("mode") == mode), key=lambda r: (r[1]["date"], r[0]))
    if not picked:
        return None
    models: dict[str, dict[str, Any]] = {}
    for name, run in picked:
        for m in run["models"]:
            models[m["model"]] = {**m, "run": name}
    used = [name for name, _ in picked if any(m["run"] == name for m in models.values())]
    return used, {**picked[-1][1], "models": list(models.values())}


def run_lines(
    kind: str,
    names: list[str],
    runs: dict[str, dict[str, Any]],
    models: list[dict[str, Any]],
    what: Callable[[str, dict[str, Any]], str],
) -> list[str]:
    """One line per run drawn on: its folder, the models it gives (all but the run giving the
    most), and ``what(name, run)``, its machine, versions and date."""
    main = max(names, key=lambda n: sum(m["run"] == n for m in models))  # named without its models
    lines = []
    for name in names:
        mine = [m["model"] for m in models if m["run"] == name]
        which = "" if name == main else " for " + ", ".join(f"`{n}`" for n in mine)
        lines += [f"[{kind} run](../benchmarks/results/{name}/){which}: {what(name, runs[name])}", ""]
    return lines


def by_config(model: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["config"]: c for c in model.get("configs", [])}


def cell(model: dict[str, Any], config: str) -> str:
    if "configs" not in model:
        return {"gpu only": "GPU only"}.get(model["status"], model["status"])
    rec = by_config(model).get(config)
    return "-" if rec is None else rec["status"]


def passes(models: list[dict[str, Any]], config: str) -> list[str]:
    return [m["model"] for m in models if cell(m, config) == "pass"]


def summary(names: list[str], runs: dict[str, dict[str, Any]], run: dict[str, Any]) -> list[str]:
    models = run["models"]
    ran = [m for m in models if "configs" in m]
    torch_ok = set(passes(ran, "torch"))
    auto_ok = set(passes(ran, "bw-auto"))
    others: dict[str, int] = {}
    for m in models:
        if "configs" not in m:
            others[cell(m, "bw-auto")] = others.get(cell(m, "bw-auto"), 0) + 1
    rest = "".join(f", {n} {status}" for status, n in sorted(others.items()))
    lines = [
        f"## Coverage: {len(models)} models, {len(ran)} run on CPU{rest}",
        "",
    ]

    def what(name: str, r: dict[str, Any]) -> str:
        backends = sorted({m.get("backend", r["backend"]) for m in ran if m["run"] == name}) or [r["backend"]]
        return (
            f"{r['machine']}, torch {r['versions']['torch']}, backend {' and '.join(f'`{b}`' for b in backends)}, "
            f"{r['steps']} SGD steps, {r['date'][:10]}."
        )

    lines += run_lines("CPU", names, runs, models, what)
    lines += [
        "| | models equal to eager DDP (pass) |",
        "| --- | ---: |",
    ]
    for config in CHECK_CONFIGS:
        label = "`torch.compile(DDP(model))`" if config == "torch" else f'bucketwise `strategy="{strategy_of(config)}"`'
        lines.append(f"| {label} | {len(passes(ran, config))} of {len(ran)} |")
    lines += [
        "",
        f"Where `torch.compile(DDP(model))` passes ({len(torch_ok)} models), bucketwise `auto` passes on "
        f"{len(torch_ok & auto_ok)}; `auto` passes on {len(auto_ok - torch_ok)} model(s) where it does not"
        + (f" ({', '.join(sorted(auto_ok - torch_ok))})" if auto_ok - torch_ok else "")
        + ".",
    ]
    return lines


def coverage_table(run: dict[str, Any]) -> list[str]:
    head = (
        "| model | built from | params | `torch` | `auto` | `fused` | `split` | `auto` strategy | graphs / breaks "
        "| segments `split` | worst rel. error `auto` | compile s `auto` |"
    )
    lines = []
    for family, title in FAMILIES.items():
        rows = [m for m in run["models"] if m.get("family") == family]
        if not rows:
            continue
        lines += ["", f"### {title}", "", head, "| --- | --- | ---: |" + " --- |" * 5 + " ---: |" * 4]
        for m in rows:
            lines.append(row(m))
    return lines


def row(m: dict[str, Any]) -> str:
    cfg = by_config(m)
    eager, auto, split = cfg.get("eager", {}), cfg.get("bw-auto", {}), cfg.get("bw-split", {})
    params = f"{eager['params']:,}" if "params" in eager else "-"
    if eager.get("trainable") not in (None, eager.get("params")):
        params += f" ({eager['trainable']:,} trained)"
    strategy = ", ".join(auto.get("strategies", [])) or "-"
    graphs = f"{auto['graphs']} / {auto['graph_breaks']}" if "graphs" in auto else "-"
    seg = str(split.get("segments", "-"))
    check = auto.get("check") or {}
    rel = "-" if check.get("rel_err") is None else f"{check['rel_err']:.1e}"
    comp = f"{auto['compile_s']:.2f}" if "compile_s" in auto else "-"
    source = m["source"] + (f"; backend `{m['backend']}`" if m.get("backend") else "")
    cells = [
        f"`{m['model']}`",
        source,
        params,
        *(cell(m, c) for c in CHECK_CONFIGS),
        strategy,
        graphs,
        seg,
        rel,
        comp,
    ]
    return "| " + " | ".join(cells) + " |"


def detail_table(run: dict[str, Any]) -> list[str]:
    """Every model and config: what the report counted (the ``torch`` anchor has no report:
    its first step, compile included, is the comparable figure)."""
    lines = [
        "",
        "## Every strategy in detail",
        "",
        "From `bucketwise.report(compiled).totals` on rank 0 (`torch.compile` keeps no such report: `n/a`); "
        "first step s: the first training step, compiling included (on a shared CPU: indicative only); worst rel. "
        "error: the largest difference from eager DDP's update over that tensor's largest update, over both "
        "ranks.",
        "",
        "| model | config | outcome | strategy | graphs | breaks | segments | fallbacks | compile s | first step s "
        "| worst rel. error |",
        "| --- | --- | --- | --- |" + " ---: |" * 7,
    ]
    for m in run["models"]:
        for c in m.get("configs", [])[1:]:

            def num(key: str, fmt: str = "{}", c: dict = c) -> str:
                if c["config"] == "torch" and key not in ("first_step_s",):
                    return "n/a"
                return "-" if c.get(key) is None else fmt.format(c[key])

            rel = (c.get("check") or {}).get("rel_err")
            lines.append(
                "| "
                + " | ".join(
                    [
                        f"`{m['model']}`",
                        f"`{c['config']}`",
                        c["status"],
                        ", ".join(c.get("strategies", [])) or "-",
                        num("graphs"),
                        num("graph_breaks"),
                        num("segments"),
                        num("fallbacks"),
                        num("compile_s", "{:.2f}"),
                        num("first_step_s", "{:.2f}"),
                        "-" if rel is None else f"{rel:.1e}",
                    ]
                )
                + " |"
            )
    return lines


def notes(run: dict[str, Any]) -> list[str]:
    out = []
    for m in run["models"]:
        if "configs" not in m:
            if m["status"] != "ran":
                out.append(f"- `{m['model']}`: {cell(m, 'auto')}: {m.get('reason', '')}")
            continue
        for c in m["configs"]:
            text = note_of(c)
            if text:
                out.append(f"- `{m['model']}`, `{c['config']}`: {text}")
    return ["", "## Notes: failures, fallbacks, strategy choices", ""] + (out or ["None."])


def note_of(c: dict[str, Any]) -> str | None:
    parts = []
    if c["status"] == "error":
        parts.append(f"error: `{c['error']}`")
    if c["status"] == "mismatch" and c.get("step_check"):
        chk = c["step_check"]
        exact = (
            f", and {chk['fp64']['ratio']:.3g} x its yardstick against the float64 twin (`{chk['fp64']['worst']}`)"
            if chk.get("fp64")
            else ""
        )
        parts.append(
            f"one step's update differs from the eager twin's: worst tensor `{chk.get('worst')}`, "
            f"error {chk.get('ratio', 0):.3g} x the tolerance{exact} (step {chk.get('step')})"
        )
    elif c["status"] == "mismatch":
        chk = c.get("check") or {}
        parts.append(
            f"not equal to eager DDP: worst tensor `{chk.get('worst')}`, "
            f"error {chk.get('ratio', 0):.3g} x the tolerance, "
            f"replica spread {c.get('replica_spread')}"
        )
    if c.get("fallback_reasons"):
        parts.append("fell back: " + "; ".join(f"`{r.splitlines()[0][:200]}`" for r in c["fallback_reasons"]))
    if c.get("eager_calls"):
        parts.append(f"{c['eager_calls']} call(s) ran eagerly")
    if c.get("strategy_reasons") and c["config"] in ("bw-auto", "bw-fused"):
        parts.append(f"strategy {', '.join(c['strategies'])}: " + "; ".join(c["strategy_reasons"]))
    return "; ".join(parts) or None


def speed_section(names: list[str], runs: dict[str, dict[str, Any]], run: dict[str, Any]) -> list[str]:
    def what(name: str, r: dict[str, Any]) -> str:
        checks = [c["step_check"] for m in r["models"] for c in m.get("configs", []) if c.get("step_check")]
        how = "checked step by step" if checks else "checked on the parameters after the last step"
        if any("fp64" in chk for chk in checks):
            how += " against fp32 and float64 twins"
        if r.get("conv_tf32") is False:
            how += ", convolutions in fp32"
        return (
            f"{r['machine']}, torch {r['versions']['torch']}, backend `{r['backend']}`, median of {r['steps']} "
            f"timed steps, {how}, {r['date'][:10]}."
        )

    lines = ["", "## Step time and peak memory, one GPU", ""] + run_lines("GPU", names, runs, run["models"], what)
    lines += [
        "One rank (world size 1: no gradient traffic), the same small models, step time in ms / peak MiB "
        "(`torch.cuda.max_memory_allocated`). `local`: the model compiled without DDP; `torch`: "
        '`torch.compile(DDP(model))`; `bw-fused`: `strategy="fused"`; `-cg`: `cudagraphs=True`. Checked at ten '
        "times the CPU tolerance (Inductor reorders float math); step by step: after the timed steps, three more, "
        "each also trained by an eager DDP twin loaded with the config's own state, and the two updates compared "
        "(CUDA-graph replays included); where a run says so, a step that misses the tolerance still passes when "
        "its distance from a float64 twin's update is within three times eager's own. Over many steps round-off "
        "grows, in BatchNorm conv nets beyond any tolerance, so the parameters after the last step are compared "
        "only in runs that say so. Image "
        "classifiers train on 8 images of 64 pixels per step here. Reproduce with "
        f"`{GPU_COMMAND}`.",
        "",
        "| model | " + " | ".join(f"`{c}`" for c in SPEED_CONFIGS) + " |",
        "| --- |" + " ---: |" * len(SPEED_CONFIGS),
    ]
    for m in run["models"]:
        if "configs" not in m:
            lines.append(f"| `{m['model']}` | " + " | ".join([m["status"]] * len(SPEED_CONFIGS)) + " |")
            continue
        cfg = by_config(m)
        cells = []
        for c in SPEED_CONFIGS:
            r = cfg.get(c)
            if r is None:
                cells.append("-")
            elif "median_ms" in r:
                mark = "" if r["status"] == "pass" else f" ({r['status']})"
                peak = "-" if r.get("peak_mib") is None else f"{r['peak_mib']:.0f}"
                cells.append(f"{r['median_ms']:.2f} / {peak}{mark}")
            else:
                cells.append(r["status"])
        lines.append(f"| `{m['model']}` | " + " | ".join(cells) + " |")
    gpu_notes = [f"- `{m['model']}`: {m['status']}: {m.get('reason', '')}" for m in run["models"] if "configs" not in m]
    gpu_notes += [
        f"- `{m['model']}`, `{c['config']}`: {note_of(c)}"
        for m in run["models"]
        for c in m.get("configs", [])
        if note_of(c)
    ]
    gpu_notes += [line for m in run["models"] if (line := round_off_note(m))]
    for name in names:  # what each run folder's README records since
        label = f"`{name}`: " if len(names) > 1 else ""
        gpu_notes += [f"- {label}{n}" for n in runs[name].get("notes", [])]
    return lines + (["", *gpu_notes] if gpu_notes else [])


def round_off_note(model: dict[str, Any]) -> str | None:
    """A note for a model whose ``local`` config (torch.compile alone) fails the check too."""
    local = by_config(model).get("local")
    if local is None or local["status"] != "mismatch":
        return None
    ratio = (local.get("step_check") or local.get("check") or {}).get("ratio", 0)
    return (
        f"- `{model['model']}`: `local` (the model compiled without DDP or bucketwise) fails the check too, at "
        f"{ratio:.3g} x the tolerance: on this model Inductor's round-off alone reaches the tolerance, so the "
        "GPU check cannot tell whether the other configs train like eager DDP; the CPU check above can, where the "
        "model runs on CPU."
    )


def not_in_gpu_run(cpu: dict[str, Any], gpu: dict[str, Any]) -> list[str]:
    """A line naming the GPU-only cases of the CPU run that the GPU run did not time."""
    timed = {m["model"] for m in gpu["models"]}
    missing = [m["model"] for m in cpu["models"] if m["status"] == "gpu only" and m["model"] not in timed]
    if not missing:
        return []
    names = ", ".join(f"`{n}`" for n in missing)
    return ["", f"Not in any GPU run: {names} (GPU-only cases): no GPU result for them yet."]


def render(results: Path) -> str:
    runs = load(results)
    checks, speeds = merged(runs, "check"), merged(runs, "speed")
    cpu = None if checks is None else checks[1]
    lines = [INTRO.rstrip("\n").replace("{worst}", worst_error(cpu) if cpu else "n/a")]
    if cpu is None:
        lines += ["", "(no zoo results under benchmarks/results/)"]
    else:
        lines += [""] + summary(checks[0], dict(runs), cpu) + coverage_table(cpu) + notes(cpu) + detail_table(cpu)
    if speeds is None:
        lines += ["", "## Step time and peak memory, one GPU", "", NO_GPU_RUN]
    else:
        lines += speed_section(speeds[0], dict(runs), speeds[1])
    if cpu and speeds:
        lines += not_in_gpu_run(cpu, speeds[1])
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0].replace("``", ""))
    p.add_argument("--check", action="store_true", help="exit 1 if docs/models.md is not current; write nothing")
    p.add_argument("--root", default=str(Path(__file__).resolve().parents[2]), help="repository root")
    args = p.parse_args(argv)
    root = Path(args.root)
    text = render(root / "benchmarks" / "results")
    doc = root / DOC
    if doc.exists() and doc.read_text() == text:
        return 0
    if args.check:
        print(f"zoo-table: {doc} is not current; run python3 -m bucketwise.benchmarks zoo-table", file=sys.stderr)
        return 1
    doc.write_text(text)
    print(f"wrote {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
