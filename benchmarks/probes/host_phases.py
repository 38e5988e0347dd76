"""Host time of a deep model's forward and backward calls, the default against ``local``: a tiny
HF Llama on the CPU (width 16, so a step is nearly all host work), one rank (gloo), ``local``
(``torch.compile(model)``) and ``bucketwise.compile(DDP(model))`` with no options, timed in
interleaved rounds; then the Python calls of one backward of each, and how many of them are
Inductor's ``reinterpret_tensor`` (a view of a buffer made by the generated code).

    python -m bucketwise.benchmarks probe host_phases [--layers 32] [--rounds 7] [--out FILE]
        [--configs local,default,shared,shared-per-block]

``shared``: the default with ``share_blocks=True``; ``shared-per-block``: the same with its
blocks' all-reduces one per block, as before NOTE [block reductions grouped].

On the GPU machines a deep model's step is bound by its host, so what the default adds here is
what it adds there, on a slower CPU.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from bucketwise._compat import collectives as cc
from bucketwise.benchmarks.probes._tiny import one_cpu_rank, tiny_llama

CALLS = 30
PROFILED = 10


CONFIGS = ("local", "default", "shared", "shared-per-block")
"""``shared``: the default with ``share_blocks=True``; ``shared-per-block``: the same with the
blocks' all-reduces left one per block (NOTE [block reductions grouped]; an Inductor
``post_grad_custom_post_pass`` of the user's own, here one that does nothing, replaces the
grouping)."""


def _models(layers: int, names: list[str]) -> dict[str, Callable[[], Any]]:
    import bucketwise

    ids = torch.randint(0, 64, (1, 8))
    out = {}
    for name in names:
        torch.manual_seed(0)
        model = tiny_llama(layers, hidden=16)
        if name == "local":
            compiled = torch.compile(model)
        elif name == "default":
            compiled = bucketwise.compile(DDP(model))
        else:
            nothing = cc.post_grad_pass(lambda graph: None, "bucketwise-probe-nothing")
            options = {"post_grad_custom_post_pass": nothing} if name == "shared-per-block" else None
            compiled = bucketwise.compile(DDP(model), share_blocks=True, options=options)
        out[name] = lambda compiled=compiled: compiled(input_ids=ids, labels=ids).loss
    return out


def _phases(forward: Callable[[], Any]) -> tuple[float, float]:
    """Milliseconds per forward call and per backward call, over ``CALLS`` steps."""
    fwd = bwd = 0.0
    for _ in range(CALLS):
        start = time.perf_counter()
        loss = forward()
        mid = time.perf_counter()
        loss.backward()
        fwd, bwd = fwd + mid - start, bwd + time.perf_counter() - mid
    return fwd / CALLS * 1e3, bwd / CALLS * 1e3


def _backward_calls(forward: Callable[[], Any]) -> dict[str, float]:
    """Python calls per backward (``cProfile``'s count) and the ``reinterpret_tensor`` among them."""
    prof = cProfile.Profile()
    for _ in range(PROFILED):
        loss = forward()
        prof.enable()
        loss.backward()
        prof.disable()
    stats = pstats.Stats(prof)
    views = sum(v[1] for k, v in stats.stats.items() if k[2].endswith("_reinterpret_tensor>"))  # type: ignore[attr-defined]
    return {"calls": stats.total_calls / PROFILED, "reinterpret_tensor": views / PROFILED}  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--configs", default="local,default", help=f"from {','.join(CONFIGS)}")
    p.add_argument("--out", default=None, help="a JSON file for the figures")
    args = p.parse_args(argv)
    names = args.configs.split(",")
    if any(n not in CONFIGS for n in names):
        p.error(f"--configs: expected names from {CONFIGS}, got {args.configs!r}")
    one_cpu_rank(29582)
    try:
        models = _models(args.layers, names)
        for forward in models.values():
            for _ in range(3):
                forward().backward()
        rounds: dict[str, list[tuple[float, float]]] = {name: [] for name in models}
        for _ in range(args.rounds):
            for name, forward in models.items():
                rounds[name].append(_phases(forward))
        result: dict[str, Any] = {"layers": args.layers, "rounds": args.rounds, "torch": torch.__version__}
        for name, forward in models.items():
            fwd = statistics.median(r[0] for r in rounds[name])
            bwd = statistics.median(r[1] for r in rounds[name])
            calls = _backward_calls(forward)
            result[name] = {"forward_ms": fwd, "backward_ms": bwd, "per_round": rounds[name], **calls}
            print(
                f"{name:>16}: forward {fwd:.3f} ms, backward {bwd:.3f} ms (medians of {args.rounds} rounds); "
                f"{result[name]['calls']:,.0f} Python calls per backward, "
                f"{result[name]['reinterpret_tensor']:,.0f} of them reinterpret_tensor"
            )
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
