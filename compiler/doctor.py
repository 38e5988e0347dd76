"""The troubleshooting ladder ("Why is my code crashing?"), per graph segment.

With ``BUCKETWISE_DOCTOR_DIR`` set, each segment's first real call also runs a copy through
``eager`` -> ``aot_eager`` -> ``inductor`` (up to the backend in use), without autograd, and
records the first stage that fails or diverges, with its graph. Training goes on normally.

Limits: forward outputs only (not gradients); a stage is compiled for the shapes of that call.
"""

from __future__ import annotations

import copy
import json
import os
import traceback
from typing import Any, Callable

import torch
import torch.fx as fx

from .._compat import dynamo as dc

DOCTOR_ENV = "BUCKETWISE_DOCTOR_DIR"
LADDER_ENV = "BUCKETWISE_DOCTOR_LADDER"
"""Comma-separated backend names to use as the ladder instead of the default (e.g. to put a
custom backend, or torch's ``*_TESTING_ONLY`` fault-injecting backends, on it)."""
LADDER = ("eager", "aot_eager", "inductor")
RTOL, ATOL = 1e-3, 1e-4


def enabled() -> bool:
    return bool(os.environ.get(DOCTOR_ENV))


def ladder_for(backend_name: str) -> tuple[str, ...]:
    """The stages to try: ``$BUCKETWISE_DOCTOR_LADDER``, else the ladder up to the backend in
    use (the whole ladder for a backend not on it)."""
    custom = os.environ.get(LADDER_ENV)
    if custom:
        return tuple(name.strip() for name in custom.split(",") if name.strip())
    return LADDER[: LADDER.index(backend_name) + 1] if backend_name in LADDER else LADDER


class Diagnosed:
    """Calls ``compiled``; on its first real call, runs the ladder on ``gm`` first."""

    def __init__(self, compiled: Callable[..., Any], gm: fx.GraphModule, where: str, backend_name: str) -> None:
        self.compiled = compiled
        self.gm = copy.deepcopy(gm)
        self.where = where
        self.stages = ladder_for(backend_name)
        self.done = False

    def __call__(self, *args: Any) -> Any:
        if not self.done and not any(dc.is_fake(a) for a in args):
            self.done = True
            record(diagnose(self.gm, args, self.where, self.stages))
        return self.compiled(*args)


def diagnose(gm: fx.GraphModule, args: tuple, where: str, stages: tuple[str, ...]) -> dict[str, Any]:
    """Run the ladder on ``gm`` with (copies of) ``args``; the first failing stage, if any."""
    with torch.no_grad():
        inputs = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]
        reference = copy.deepcopy(gm)(*inputs)
        result: dict[str, Any] = {"where": where, "stages": list(stages), "first_failure": None}
        for stage in stages:
            try:
                fn = dc.make_backend(stage, None, None, None)(copy.deepcopy(gm), list(inputs))
                out = fn(*[a.clone() if isinstance(a, torch.Tensor) else a for a in inputs])
                problem = _compare(out, reference)
            except Exception as exc:  # noqa: BLE001 - what the ladder is for
                problem = f"{type(exc).__name__}: {exc}"
                result["traceback"] = traceback.format_exc()[-4000:]
            if problem:
                result["first_failure"] = {"stage": stage, "error": problem[:2000]}
                result["graph_file"] = _save_graph(gm, where, stage)
                break
    return result


def _compare(out: Any, reference: Any) -> str | None:
    outs, refs = _leaves(out), _leaves(reference)
    if len(outs) != len(refs):
        return f"numerics: {len(outs)} outputs, eager gives {len(refs)}"
    for i, (o, r) in enumerate(zip(outs, refs)):
        if isinstance(r, torch.Tensor):
            if not torch.allclose(o.float(), r.float(), rtol=RTOL, atol=ATOL, equal_nan=True):
                diff = (o.float() - r.float()).abs().max().item()
                return f"numerics: output {i} differs from eager by up to {diff:.3g} (rtol {RTOL}, atol {ATOL})"
    return None


def _leaves(obj: Any) -> list[Any]:
    return list(obj) if isinstance(obj, (tuple, list)) else [obj]


def _save_graph(gm: fx.GraphModule, where: str, stage: str) -> str:
    folder = os.environ[DOCTOR_ENV]
    os.makedirs(folder, exist_ok=True)
    rank = os.environ.get("RANK", "0")
    path = os.path.join(folder, f"{where.replace(' ', '-')}-{stage}-rank{rank}.py")
    with open(path, "w") as f:
        f.write(f"# bucketwise doctor: {where}, first failing stage: {stage}\n")
        f.write(gm.print_readable(print_output=False))
    return path


def record(result: dict[str, Any]) -> None:
    """Append one finding to ``$BUCKETWISE_DOCTOR_DIR/doctor-rank<R>.jsonl``."""
    folder = os.environ[DOCTOR_ENV]
    os.makedirs(folder, exist_ok=True)
    rank = os.environ.get("RANK", "0")
    with open(os.path.join(folder, f"doctor-rank{rank}.jsonl"), "a") as f:
        f.write(json.dumps(result) + "\n")


def summarize(folder: str) -> list[str]:
    """Lines describing every finding of a doctor run (all ranks)."""
    findings = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.startswith("doctor-rank") and name.endswith(".jsonl"):
            rank = name.removeprefix("doctor-rank").removesuffix(".jsonl")
            with open(os.path.join(folder, name)) as f:
                findings += [(rank, json.loads(line)) for line in f if line.strip()]
    if not findings:
        return ["bucketwise doctor: no compiled segment ran (nothing to diagnose)"]
    failed = [(r, f) for r, f in findings if f["first_failure"]]
    stages = " -> ".join(findings[0][1]["stages"])
    lines = [f"bucketwise doctor: {len(findings)} segment run(s) checked through {stages}, {len(failed)} failing"]
    for rank, f in failed:
        first = f["first_failure"]
        lines.append(f"rank {rank} {f['where']}: first fails at {first['stage']}: {first['error'][:300]}")
        lines.append(f"  graph saved to {f['graph_file']}")
    return lines
