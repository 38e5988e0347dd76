"""The model zoo: real architectures under ``bucketwise.compile`` against eager DDP.

    # CPU, 2 gloo ranks: every model, configs torch, auto, fused, split against eager DDP
    python3 -m bucketwise.benchmarks zoo --out benchmarks/results/<date>_cpu-2rank_zoo
    # one GPU (NCCL, world size 1, Inductor): step time and peak memory of the ``gpu`` subset,
    # models in order until --budget-s (420 s) is spent
    python3 -m bucketwise.benchmarks zoo --device cuda --out /tmp/zoo-gpu

Each model runs in fresh processes (one per rank, a gloo or NCCL group through a file store):
eager DDP trains ``--steps`` steps, then every config trains the same steps from the same
parameters on the same batches (``zoo/train.py``). ``OUT/zoo.json`` is rewritten after every
model, so a run that dies keeps the models done so far; a model that fails or hangs is recorded
and the next one runs. ``benchmarks/tables/zoo.py`` turns the results into ``docs/models.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bucketwise.benchmarks.core.meta import run_meta
from bucketwise.benchmarks.core.names import check_names
from bucketwise.benchmarks.zoo.procs import importable, run_ranks
from bucketwise.benchmarks.zoo.registry import MODELS, select
from bucketwise.benchmarks.zoo.speed import CONV_TF32
from bucketwise.benchmarks.zoo.train import CHECKABLE_CONFIGS, SPEED_CONFIGS

MIN_MODEL_S = 45.0
"""A model is not started with less of ``--budget-s`` left than this."""


@dataclasses.dataclass(kw_only=True)
class ZooArgs:
    models: str
    device: str
    mode: str
    out: Path
    steps: int
    nproc: int
    backend: str
    backend_given: bool
    """``--backend`` was passed: every model runs with it (else a model's ``cpu_backend`` wins on CPU)."""
    timeout_s: float
    budget_s: float | None
    configs: tuple[str, ...] | None

    def backend_for(self, model: Any) -> str:
        """``--backend`` where given, else the model's ``cpu_backend`` on CPU, else the default."""
        if self.device == "cpu" and model.cpu_backend and not self.backend_given:
            return model.cpu_backend
        return self.backend

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.mode not in ("check", "speed"):
            raise ValueError(f"--mode must be check or speed, got {self.mode!r}")
        if self.steps < 1 or self.nproc < 1:
            raise ValueError("--steps and --nproc must be at least 1")
        if self.timeout_s <= 0 or (self.budget_s is not None and self.budget_s <= 0):
            raise ValueError("--timeout-s and --budget-s must be positive")
        select(self.models)  # raises KeyError naming the zoo's models
        known = SPEED_CONFIGS if self.mode == "speed" else CHECKABLE_CONFIGS
        check_names(self.configs or (), known, flag=f"--configs (with --mode {self.mode})")


def parse(argv: list[str] | None) -> ZooArgs:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--models",
        default=None,
        help="all (default on cpu), a subset (ci; gpu, the default on cuda) or "
        "comma-separated names: " + ", ".join(MODELS),
    )
    p.add_argument("--device", default="cpu", help="cpu (gloo ranks) or cuda (NCCL, one GPU per rank)")
    p.add_argument(
        "--mode",
        default=None,
        help="check (against eager DDP: torch, auto, fused, split; default on cpu) or "
        "speed (step time and peak memory: local, torch, bw-fused, bw-fused-cg; default on cuda)",
    )
    p.add_argument("--out", required=True, help="output folder (zoo.json)")
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="training steps (default: 3 with --mode check; 10 timed after 3 warm-up with --mode speed)",
    )
    p.add_argument("--nproc", type=int, default=None, help="ranks (default: 2 on cpu, 1 on cuda)")
    p.add_argument(
        "--backend",
        default=None,
        help="default: inductor on cuda; aot_eager on cpu, but inductor for the cases about Inductor's own kernels",
    )
    p.add_argument("--configs", default=None, help="comma-separated subset of the configs")
    p.add_argument(
        "--timeout-s",
        type=float,
        default=None,
        help="per model; a model past it is killed and recorded (default: 900 on cpu, 150 on cuda)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="whole run; models not started in time are recorded as not run (default: none on cpu, 420 on cuda)",
    )
    a = p.parse_args(argv)
    cuda = a.device == "cuda"
    mode = a.mode or ("speed" if cuda else "check")
    return ZooArgs(
        models=a.models or ("gpu" if cuda else "all"),
        device=a.device,
        mode=mode,
        out=Path(a.out),
        steps=a.steps or (10 if mode == "speed" else 3),
        nproc=a.nproc or (1 if cuda else 2),
        backend=a.backend or ("inductor" if cuda else "aot_eager"),
        backend_given=a.backend is not None,
        timeout_s=a.timeout_s or (150.0 if cuda else 900.0),
        budget_s=a.budget_s if a.budget_s is not None else (420.0 if cuda else None),
        configs=tuple(a.configs.split(",")) if a.configs else None,
    )


def versions() -> dict[str, str | None]:
    import importlib.metadata as md

    out: dict[str, str | None] = {"torch": torch.__version__, "python": platform.python_version()}
    for pkg in ("bucketwise", "transformers", "torchvision", "timm", "peft"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def meta(args: ZooArgs) -> dict[str, Any]:
    if args.device == "cuda":
        machine = f"{args.nproc} x {torch.cuda.get_device_name(0)}, NCCL"
    else:
        machine = f"CPU ({os.cpu_count()} cores, {platform.machine()}), {args.nproc} gloo ranks"
    return {
        **run_meta(),
        "type": "zoo",
        "machine": machine,
        "device": args.device,
        "world_size": args.nproc,
        "backend": args.backend,
        "steps": args.steps,
        "mode": args.mode,
        "versions": versions(),
        **({"conv_tf32": CONV_TF32} if args.mode == "speed" else {}),
    }


def run_one(model: Any, args: ZooArgs, work: Path, *, timeout_s: float) -> dict[str, Any]:
    if args.device == "cpu" and model.gpu_only:
        return {"model": model.name, "status": "gpu only", "reason": model.gpu_only}
    broken = {p: importable(p) for p in model.needs if importable(p)}
    if broken:
        return {
            "model": model.name,
            "status": "skipped",
            "reason": "; ".join(f"import {p} failed: {why}" for p, why in broken.items()),
        }
    backend = args.backend_for(model)
    opts = {
        "mode": args.mode,
        "device": args.device,
        "backend": backend,
        "steps": args.steps,
        "configs": args.configs,
    }
    t0 = time.perf_counter()
    outcome = run_ranks(model.name, opts, nproc=args.nproc, device=args.device, work=work, timeout_s=timeout_s)
    outcome["seconds"] = round(time.perf_counter() - t0, 1)
    if backend != args.backend:
        outcome["backend"] = backend
    return outcome


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    record = {**meta(args), "models": []}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="zoo-") as work:
        for model in select(args.models):
            left = None if args.budget_s is None else args.budget_s - (time.perf_counter() - start)
            if left is not None and left < MIN_MODEL_S:
                result = {
                    "model": model.name,
                    "status": "not run",
                    "reason": f"past the --budget-s of {args.budget_s:g} s",
                }
            else:
                print(f"zoo: {model.name} ...", flush=True)
                by_budget = left is not None and left < args.timeout_s
                result = run_one(model, args, Path(work), timeout_s=left if by_budget else args.timeout_s)
                if by_budget and result.get("timed_out"):
                    result = stopped_by_budget(result, left, args.budget_s)
            result = {"model": model.name, "family": model.family, "source": model.source, **result}
            record["models"].append(result)
            print(f"zoo: {model.name}: {summary(result)}", flush=True)
            write(args.out / "zoo.json", record)
    print(f"zoo: wrote {args.out / 'zoo.json'} ({time.perf_counter() - start:.0f} s)")
    return 0


def stopped_by_budget(result: dict[str, Any], left: float, budget_s: float) -> dict[str, Any]:
    """A model cut short by the run's ``--budget-s``, not by its own ``--timeout-s``: not a
    failure of the model, so recorded as not run, with how to run it."""
    return {
        **{k: v for k, v in result.items() if k not in ("timed_out", "traceback")},
        "status": "not run",
        "reason": f"stopped after {left:.0f} s, when the run's --budget-s of {budget_s:g} s ran out: "
        f"run it alone (--models {result['model']})",
    }


def summary(result: dict[str, Any]) -> str:
    if "configs" not in result:
        return f"{result['status']} ({result.get('reason', '')})"
    return ", ".join(f"{c['config']} {c['status']}" for c in result["configs"]) + f" ({result.get('seconds')} s)"


def write(path: Path, record: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=False) + "\n")
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
