"""Where a cold first step's compile goes as the model deepens, on the CPU: per phase, the seconds
that repeat per block and those paid once, with shared blocks (NOTE [one compile per block]).

    python -m bucketwise.benchmarks probe compile_depth [--layers 8,32] [--backend inductor]

The ``llama`` model of ``benchmarks/core/models.py`` (HF ``LlamaForCausalLM``), tiny (``SIZES``),
at each depth, ``fused``, ``share_blocks=True``, one rank (gloo), each depth a new process over an
empty Inductor cache, so every run is cold. Prints each run's compile-time breakdown
(``bucketwise.report``: Dynamo, AOTAutograd, the backend, and the shared block's own compile,
which is in the AOTAutograd and backend figures too) as ``DEPTH {json}``, then, between the
shallowest and the deepest run, the seconds per added block of each phase and what is left of it
at no blocks (``SLOPE {json}``). The GPU's cold first steps are in ``comm_passes cold`` and ``tax
--restarts``; this probe's figures are the host's work only (and, with Inductor on the CPU, its
C++ compiles, which are paid once).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

from bucketwise.benchmarks.core import procs
from bucketwise.benchmarks.tax.restarts import child_env

SIZES = {"d_model": 64, "heads": 4, "seq": 32, "batch": 2, "vocab": 256}
"""The ``llama`` model of ``benchmarks/core/models.py``, tiny, at each depth."""
CHILD_TIMEOUT_S = 1800
"""A depth's process, at the most (Inductor's C++ compiles on a 2-core CPU included)."""
PHASES = ("dynamo_s", "aot_autograd_s", "backend_s", "block_s", "first_step_s")


def one(layers: int, backend: str) -> dict[str, float]:
    """One cold first step (forward and backward) at ``layers`` blocks, in this process."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bucketwise
    from bucketwise.benchmarks.core.models import make_spec

    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        spec = make_spec("llama", {"layers": layers, **SIZES})
        torch.manual_seed(0)
        model = bucketwise.compile(DDP(spec.build()), strategy="fused", share_blocks=True, backend=backend)
        batch = spec.make_batch(0, torch.device("cpu"))
        start = time.perf_counter()
        spec.loss(model, batch).backward()
        first = time.perf_counter() - start
        report = bucketwise.report(model).to_dict()
        times = report["totals"]["compile_times"]
        shared = [g["shared_blocks"] for g in report["graphs"] if g.get("shared_blocks")]
        if len(shared) != 1 or shared[0]["count"] != layers:
            raise AssertionError(f"expected {layers} blocks sharing one compile, got {shared}")
        return {
            "layers": layers,
            "dynamo_s": times["dynamo_s"],
            "aot_autograd_s": times["aot_autograd_s"],
            "backend_s": times["backend_s"],
            "block_s": shared[0]["compile_seconds"],
            "first_step_s": round(first, 3),
        }
    finally:
        dist.destroy_process_group()


def slope(shallow: dict[str, float], deep: dict[str, float]) -> dict[str, dict[str, float]]:
    """Per phase: seconds per added block between two runs, and the line's value at no blocks."""
    blocks = deep["layers"] - shallow["layers"]
    out = {}
    for phase in PHASES:
        per_block = (deep[phase] - shallow[phase]) / blocks
        out[phase] = {
            "per_block_s": round(per_block, 4),
            "at_no_blocks_s": round(shallow[phase] - per_block * shallow["layers"], 3),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bucketwise.benchmarks probe compile_depth", description=__doc__.splitlines()[0]
    )
    p.add_argument("--layers", default="8,32", help="depths, comma-separated, at least two (default 8,32)")
    p.add_argument("--backend", default="inductor", choices=("inductor", "aot_eager"))
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child process: one depth
    args = p.parse_args(argv)
    if args.one is not None:
        print("DEPTH", json.dumps(one(args.one, args.backend)), flush=True)
        return 0
    try:
        depths = sorted({int(n) for n in args.layers.split(",")})
    except ValueError:
        p.error(f"--layers: expected depths like 8,32, got {args.layers!r}")
    if len(depths) < 2 or depths[0] < 2:
        p.error(f"--layers: expected two or more depths of 2 blocks or more, got {args.layers!r}")
    runs = []
    for layers in depths:
        with tempfile.TemporaryDirectory(prefix="bucketwise-compile-depth-") as cache:
            cmd = procs.python("-m", "bucketwise.benchmarks.probes.compile_depth", "--one", str(layers))
            env = {**child_env(cache), "MASTER_ADDR": "127.0.0.1"}
            done = procs.run(
                [procs.Proc([*cmd, "--backend", args.backend])],
                env=env,
                timeout_s=CHILD_TIMEOUT_S,
                capture=procs.Capture.ALL,
            )
        line = next((line for line in done.stdout.splitlines() if line.startswith("DEPTH ")), None)
        if done.timed_out or done.code != 0 or line is None:
            print(done.stdout[-2000:], done.stderr[-4000:], sep="\n", file=sys.stderr)
            why = f"timed out after {CHILD_TIMEOUT_S} s" if done.timed_out else f"exit {done.code}"
            print(f"compile_depth: the run at {layers} layers failed ({why})", file=sys.stderr)
            return 1
        print(line, flush=True)
        runs.append(json.loads(line[len("DEPTH ") :]))
    print("SLOPE", json.dumps({"between": [depths[0], depths[-1]], **slope(runs[0], runs[-1])}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
