"""What the autograd engine's per-parameter work costs the host: a backward that hands N gradients
to autograd (one ``AccumulateGrad`` per parameter) against one that sets ``param.grad`` itself.

    python -m bucketwise.benchmarks probe engine_grads [--params 75] [--numel 16] [--rounds 5] \\
        [--steps 1000] [--out DIR]

One custom ``autograd.Function`` stands for a compiled graph; its backward returns each gradient
as a fresh view of one flat bucket, as bucketwise's fused backward does, so ``AccumulateGrad``
takes it without a copy (``engine``). ``direct`` keeps one dummy input requiring grad and sets
each ``param.grad`` to the same fresh view inside the backward. Tiny tensors, one torch thread:
the times are the host's. Interleaved rounds of ``--steps`` backward calls; the median per round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

MODES = ("engine", "direct")


def _functions(params: list[torch.nn.Parameter], bucket: torch.Tensor, numel: int):
    def views() -> list[torch.Tensor]:
        return [bucket[i * numel : (i + 1) * numel] for i in range(len(params))]

    class Engine(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, *ps):  # noqa: ANN001, ANN205
            return x.sum()

        @staticmethod
        def backward(ctx, grad):  # noqa: ANN001, ANN205
            return (None, *views())

    class Direct(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, dummy):  # noqa: ANN001, ANN205
            return x.sum()

        @staticmethod
        def backward(ctx, grad):  # noqa: ANN001, ANN205
            for p, v in zip(params, views()):
                p.grad = v
            return None, None

    return Engine, Direct


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=sys.argv[0], description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=75, help="parameters (HF Llama 8 layers has 75)")
    parser.add_argument("--numel", type=int, default=16, help="elements per parameter")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    params = [torch.nn.Parameter(torch.zeros(args.numel)) for _ in range(args.params)]
    bucket = torch.zeros(args.numel * args.params)
    engine, direct = _functions(params, bucket, args.numel)
    x, dummy = torch.zeros(4), torch.zeros((), requires_grad=True)
    losses = {"engine": lambda: engine.apply(x, *params), "direct": lambda: direct.apply(x, dummy)}

    def backward_us(mode: str) -> float:
        loss = losses[mode]()
        start = time.perf_counter()
        loss.backward()
        took = time.perf_counter() - start
        for p in params:
            assert p.grad is not None and p.grad.data_ptr() >= bucket.data_ptr()  # a view of the bucket
            p.grad = None
        return took * 1e6

    rounds: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            for _ in range(args.steps // 5):  # warm
                backward_us(mode)
            rounds[mode].append(statistics.median(backward_us(mode) for _ in range(args.steps)))
    summary = {
        mode: {"median_us": statistics.median(v), "min_us": min(v), "max_us": max(v), "rounds_us": v}
        for mode, v in rounds.items()
    }
    for mode, s in summary.items():
        print(f"{mode}: backward {s['median_us']:.1f} us ({s['min_us']:.1f}-{s['max_us']:.1f})", flush=True)
    if args.out:
        from bucketwise.benchmarks.core.meta import run_meta

        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"meta": {**run_meta(), **vars(args)}, "modes": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
