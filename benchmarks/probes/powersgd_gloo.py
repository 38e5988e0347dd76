"""torch's ``powerSGD_hook`` on one gloo rank with several buckets: does training go on?

    python -m bucketwise.benchmarks probe powersgd_gloo [--modes eager,default,split] [--runs 1] \\
        [--steps 8] [--timeout 150] [--out DIR]

Each run is a fresh process that trains bucketwise's small GPT (2 layers, width 64, vocabulary
512, 64 tokens, batch 4) in DDP with ``bucket_cap_mb=0.05`` (several buckets) and torch's
``powerSGD_hook`` (rank 1, compressing from step 2), one torch thread. ``eager`` is DDP alone: its
process loads ``launch/models.py`` by path and never imports bucketwise, so a stop there is
torch's. ``default`` is ``bucketwise.compile(DDP(model))``; ``split`` adds ``strategy="split"``
(which raises at compile since ``split`` refuses this case, NOTE [PowerSGD on gloo]).
A run still going after ``--timeout`` seconds writes its threads' stacks (faulthandler) and ends;
the probe prints, per run, the steps it finished. ``--out`` gets ``results.json`` and the stacks
of each run that stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

MODES = ("eager", "default", "split")


def _child(mode: str, steps: int, timeout: float) -> int:
    import faulthandler
    import importlib.util
    import tempfile

    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P
    from torch.nn.parallel import DistributedDataParallel as DDP

    faulthandler.dump_traceback_later(timeout, exit=True)
    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("models", Path(__file__).resolve().parents[2] / "launch/models.py")
    models = sys.modules["models"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(models)
    store = tempfile.mkdtemp()
    dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
    cfg = models.GPTConfig(vocab=512, seq=64, layers=2, d_model=64, heads=4)
    model = DDP(models.GPT(cfg), bucket_cap_mb=0.05)
    state = P.PowerSGDState(
        process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2, min_compression_rate=0.5
    )
    model.register_comm_hook(state, P.powerSGD_hook)
    if mode != "eager":
        import bucketwise

        model = bucketwise.compile(model, **({"strategy": mode} if mode != "default" else {}))
    for step in range(steps):
        x, y = models.synthetic_tokens(cfg, 4, seed=step)
        model(x, y).backward()
        print(f"STEP {step}", flush=True)
    dist.destroy_process_group()
    return 0


def _one_run(mode: str, args: argparse.Namespace) -> tuple[dict, str]:
    env = {**os.environ, "BUCKETWISE_PROGRESS": "0"}
    command = [sys.executable, __file__, "--child", mode, str(args.steps), str(args.timeout)]
    start = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=args.timeout + 60)
        out, err, rc = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        out, err, rc = e.stdout or "", e.stderr or "", None
        out, err = (s.decode() if isinstance(s, bytes) else s for s in (out, err))
    steps_done = sum(line.startswith("STEP ") for line in out.splitlines())
    run = {
        "mode": mode,
        "steps": args.steps,
        "steps_done": steps_done,
        "trained": rc == 0 and steps_done == args.steps,
        "returncode": rc,
        "seconds": round(time.monotonic() - start, 1),
    }
    return run, err


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=sys.argv[0], description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--runs", type=int, default=1, help="fresh processes per mode, interleaved")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds before a run counts as stopped")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    if bad := [m for m in modes if m not in MODES]:
        parser.error(f"--modes: unknown mode {bad[0]!r}; known modes: {', '.join(MODES)}")
    runs = []
    for i in range(args.runs):
        for mode in modes:
            run, err = _one_run(mode, args)
            run["run"] = i
            runs.append(run)
            print("RUN", json.dumps(run), flush=True)
            if args.out and not run["trained"]:
                os.makedirs(args.out, exist_ok=True)
                Path(args.out, f"stderr-{mode}-{i}.txt").write_text(err)
    if args.out:
        from bucketwise.benchmarks.core.meta import run_meta

        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"meta": run_meta(), "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        raise SystemExit(_child(sys.argv[2], int(sys.argv[3]), float(sys.argv[4])))
    raise SystemExit(main())
