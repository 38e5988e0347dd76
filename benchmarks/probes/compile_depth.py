"""Where a cold first step's compile goes as the model deepens: per phase, the seconds
that repeat per block and those paid once, with shared blocks (NOTE [one compile per block]).

    python -m bucketwise.benchmarks probe compile_depth [--layers 8,32] [--backend inductor] [--floor]
        [--device cpu] [--out DIR]

The ``llama`` model of ``benchmarks/core/models.py`` (HF ``LlamaForCausalLM``), tiny (``SIZES``),
at each depth, ``fused``, ``share_blocks=True``, one rank (gloo), each depth a new process over an
empty Inductor cache, so every run is cold. ``--device cuda`` runs it on the GPU instead, at the
benchmarks' own sizes for the model (those of ``tax``), under bf16 autocast, one rank (NCCL).
Prints each run's compile-time breakdown (``bucketwise.report``: Dynamo, AOTAutograd, the
backend, and the shared block's own compile, which is in the AOTAutograd and backend figures too)
as ``DEPTH {json}``, then, between the shallowest and the deepest run, the seconds per added
block of each phase and what is left of it at no blocks (``SLOPE {json}``). On the CPU, the
figures are the host's work only (and Inductor's C++ compiles, paid once, which on a slow host
drown the per-block part: hosts of 16 slower cores took 40 s for them); the GPU's cold first steps
of whole training steps are in ``tax --restarts``.

``--floor`` measures, instead, what any design that keeps every block inside the one graph
Dynamo, AOTAutograd and the backend see must pay per block, whatever it does inside the block:
the same model with each block's forward one opaque operator on its hidden state and its own
parameters (``bucketwise_probe::opaque_block``, whose backward is one operator too, returning a
gradient per parameter), under plain ``torch.compile`` without DDP, so no all-reduce either.
Only the first step is timed (``FLOOR {json}`` per depth, ``FLOOR_SLOPE {json}``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import tempfile
import time
from typing import Callable

from bucketwise.benchmarks.core import procs
from bucketwise.benchmarks.tax.restarts import child_env

SIZES = {"d_model": 64, "heads": 4, "seq": 32, "batch": 2, "vocab": 256}
"""The ``llama`` model of ``benchmarks/core/models.py``, tiny, at each depth."""
CHILD_TIMEOUT_S = 1800
"""A depth's process, at the most (Inductor's C++ compiles on a 2-core CPU included)."""
PHASES = ("dynamo_s", "aot_autograd_s", "backend_s", "block_s", "first_step_s")


def one(layers: int, backend: str, device: str = "cpu") -> dict[str, float]:
    """One cold first step (forward and backward) at ``layers`` blocks, in this process."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bucketwise

    cuda = device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    try:
        spec, dev = _spec(layers, device)
        torch.manual_seed(0)
        ddp = DDP(spec.build().to(dev), device_ids=[0] if cuda else None)
        model = bucketwise.compile(ddp, strategy="fused", share_blocks=True, backend=backend)
        first = _first_step(spec, model, dev)
        report = bucketwise.report(model).to_dict()
        times = report["totals"]["compile_times"]
        shared = [s for g in report["graphs"] if "count" in (s := g.get("shared_blocks") or {})]
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


def _spec(layers: int, device: str):
    """The model at ``layers`` blocks, tiny on the CPU, at the benchmarks' sizes on the GPU."""
    import torch

    from bucketwise.benchmarks.core.models import make_spec

    if device == "cuda":
        return make_spec("llama", {"layers": layers}), torch.device("cuda", 0)
    return make_spec("llama", {"layers": layers, **SIZES}), torch.device("cpu")


def _first_step(spec, model, dev) -> float:
    """Seconds of the first forward and backward (the compile), the GPU synchronised."""
    import torch

    batch = spec.make_batch(0, dev)
    start = time.perf_counter()
    with spec.autocast(dev):
        loss = spec.loss(model, batch)
    loss.backward()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter() - start


def floor(layers: int, backend: str, device: str = "cpu") -> dict[str, float]:
    """One cold first step at ``layers`` blocks, each one opaque operator (``--floor``), in this
    process."""
    import types

    import torch

    spec, dev = _spec(layers, device)
    torch.manual_seed(0)
    model = spec.build().to(dev)
    _, opaque = _opaque_ops()
    for block in model.model.layers:
        block.forward = types.MethodType(_opaque_forward(block, opaque), block)
    first = _first_step(spec, torch.compile(model, backend=backend), dev)
    missing = [n for n, p in model.named_parameters() if p.grad is None and ".layers." in n]
    if missing:
        raise AssertionError(f"expected a gradient for every block parameter, got none for {missing[:3]}")
    return {"layers": layers, "first_step_s": round(first, 3)}


def _opaque_forward(block, opaque):
    """The block's forward as one ``opaque`` call on its parameters, in straight lines (as
    bucketwise's own block forward: NOTE [a block call in straight lines]), so that Dynamo's
    cost per block is that of the call, not of a loop over the parameters."""
    params = ", ".join(f"self.{name}" for name, _ in block.named_parameters())
    scope = {"opaque": opaque}
    exec(f"def forward(self, hidden_states, *args, **kwargs):\n    return opaque(hidden_states, [{params}])\n", scope)  # noqa: S102
    return scope["forward"]


@functools.cache
def _opaque_ops():
    """``bucketwise_probe::opaque_block(x, params)``: a copy of ``x``; its backward one operator
    too, the gradient of ``x`` and a zero gradient per parameter. Defined once per process (the
    cache keeps the library, and so the operators, alive)."""
    import torch

    lib = torch.library.Library("bucketwise_probe", "FRAGMENT")
    lib.define("opaque_block(Tensor x, Tensor[] params) -> Tensor")
    lib.define("opaque_block_backward(Tensor grad, Tensor x, Tensor[] params) -> Tensor[]")

    def forward(x, params):
        return x.clone()

    def backward_kernel(grad, x, params):
        return [grad.clone(), *(torch.zeros_like(p) for p in params)]

    def backward_fake(grad, x, params):
        return [torch.empty_like(grad), *(torch.empty_like(p) for p in params)]

    def setup_context(ctx, inputs, output):
        ctx.x, ctx.params = inputs

    def backward(ctx, grad):
        grads = torch.ops.bucketwise_probe.opaque_block_backward(grad, ctx.x, ctx.params)
        return grads[0], list(grads[1:])

    lib.impl("opaque_block", forward, "CompositeExplicitAutograd")
    lib.impl("opaque_block_backward", backward_kernel, "CompositeExplicitAutograd")
    torch.library.register_fake("bucketwise_probe::opaque_block", lambda x, params: torch.empty_like(x), lib=lib)
    torch.library.register_fake("bucketwise_probe::opaque_block_backward", backward_fake, lib=lib)
    torch.library.register_autograd("bucketwise_probe::opaque_block", backward, setup_context=setup_context, lib=lib)
    return lib, torch.ops.bucketwise_probe.opaque_block


def slope(
    shallow: dict[str, float], deep: dict[str, float], phases: tuple[str, ...] = PHASES
) -> dict[str, dict[str, float]]:
    """Per phase: seconds per added block between two runs, and the line's value at no blocks."""
    blocks = deep["layers"] - shallow["layers"]
    out = {}
    for phase in phases:
        per_block = (deep[phase] - shallow[phase]) / blocks
        out[phase] = {
            "per_block_s": round(per_block, 4),
            "at_no_blocks_s": round(shallow[phase] - per_block * shallow["layers"], 3),
        }
    return out


@dataclasses.dataclass(frozen=True)
class Variant:
    """What the probe measures: shared blocks, or the floor (``--floor``)."""

    name: str
    run: Callable[[int, str, str], dict[str, float]]
    """One depth, in this process: ``run(layers, backend, device)``."""
    label: str
    """The prefix of a depth's printed line."""
    slope_label: str
    """The prefix of the slope's."""
    phases: tuple[str, ...]
    """What the slope is taken of."""


VARIANTS = {
    False: Variant("shared", one, "DEPTH", "SLOPE", PHASES),
    True: Variant("floor", floor, "FLOOR", "FLOOR_SLOPE", ("first_step_s",)),
}
"""By ``--floor``."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bucketwise.benchmarks probe compile_depth", description=__doc__.splitlines()[0]
    )
    p.add_argument("--layers", default="8,32", help="depths, comma-separated, at least two (default 8,32)")
    p.add_argument("--backend", default="inductor", choices=("inductor", "aot_eager"))
    p.add_argument(
        "--floor",
        action="store_true",
        help="each block one opaque operator under plain torch.compile: the cost per block of the graph alone",
    )
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--out", help="a folder to write results.json to: the run's meta, every depth and the slope")
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child process: one depth
    args = p.parse_args(argv)
    variant = VARIANTS[args.floor]
    if args.one is not None:
        print(variant.label, json.dumps(variant.run(args.one, args.backend, args.device)), flush=True)
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
            cmd += ["--device", args.device, *(["--floor"] if args.floor else [])]
            env = {**child_env(cache), "MASTER_ADDR": "127.0.0.1"}
            done = procs.run(
                [procs.Proc([*cmd, "--backend", args.backend])],
                env=env,
                timeout_s=CHILD_TIMEOUT_S,
                capture=procs.Capture.ALL,
            )
        line = next((line for line in done.stdout.splitlines() if line.startswith(f"{variant.label} ")), None)
        if done.timed_out or done.code != 0 or line is None:
            print(done.stdout[-2000:], done.stderr[-4000:], sep="\n", file=sys.stderr)
            why = f"timed out after {CHILD_TIMEOUT_S} s" if done.timed_out else f"exit {done.code}"
            print(f"compile_depth: the run at {layers} layers failed ({why})", file=sys.stderr)
            return 1
        print(line, flush=True)
        runs.append(json.loads(line[len(variant.label) + 1 :]))
    between = {"between": [depths[0], depths[-1]], **slope(runs[0], runs[-1], variant.phases)}
    print(variant.slope_label, json.dumps(between), flush=True)
    if args.out:
        _write(args, variant, runs, between)
    return 0


def _write(args: argparse.Namespace, variant: Variant, runs: list[dict[str, float]], between: dict) -> None:
    import os

    from bucketwise.benchmarks.core.meta import run_meta

    spec, _ = _spec(runs[0]["layers"], args.device)
    meta = {
        **run_meta(),
        "variant": variant.name,
        "backend": args.backend,
        "model": spec.name,
        "sizes": {k: v for k, v in spec.sizes.items() if k != "layers"},
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"meta": meta, "depths": runs, "slope": between}, f, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
