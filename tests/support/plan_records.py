"""What a report records of its graphs' plans (NOTE [one plan per graph]), nothing timed, and
where two such records differ: the 2-rank plan tests on the CPU and on 2 GPUs compare them."""

from __future__ import annotations

from typing import Any


def _untimed(d: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if d is None else {k: v for k, v in d.items() if "seconds" not in k}


def plan_record(report: dict[str, Any]) -> dict[str, Any]:
    """What ``report`` (``bucketwise.report(compiled).to_dict()``) records of its graphs' plans:
    per graph its strategy and why, its buckets (every field: parameters, bytes, segment, wire
    dtype, collective, where issued), its segments' parameters and backend, its shared blocks
    without their seconds, its comm hook and unused parameters; and the blocks left unshared and
    the notes (the plans' reasons). Nothing timed."""
    graphs = [
        {
            "strategy": g["strategy"],
            "strategy_reason": g["strategy_reason"],
            "variant": g["variant"],
            "plan_source": g["plan_source"],
            "buckets": [_untimed(b) for b in g["buckets"]],
            "segments": [
                {k: s[k] for k in ("params", "bytes", "backend", "fell_back", "reason")} for s in g["segments"]
            ],
            "shared_blocks": _untimed(g["shared_blocks"]),
            "comm_hook": g["comm_hook"],
            "unused_params": g["unused_params"],
        }
        for g in report["graphs"]
    ]
    return {"graphs": graphs, "unshared_blocks": report["unshared_blocks"], "notes": report["notes"]}


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two records differ, one line each (``graphs[0].buckets[1].params: [...] != [...]``)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}.{k}: only in one" for k in a.keys() ^ b.keys()]
        return out + [d for k in a.keys() & b.keys() for d in differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]
