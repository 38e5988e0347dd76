"""Command line of the ``ddp`` harness: flags, their validation, the NCCL environment and the
self-relaunch through ``torch.distributed.run``."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Mapping

from bucketwise.benchmarks.core import models as bench_models
from bucketwise.benchmarks.core import procs
from bucketwise.benchmarks.core.configs import CONFIGS, DEFAULT_CONFIGS, base_name, recipe_for
from bucketwise.benchmarks.core.output import RECORD_ENV  # noqa: F401 (ddp.bench reads it here)
from bucketwise.benchmarks.core.procs import ALWAYS_ENV

RESULTS_ROOT = Path(__file__).resolve().parents[1] / "results"
NETS = ("default", "socket", "2node")
DEVICES = ("auto", "cuda", "cpu")
COMMAND_ENV = "BUCKETWISE_BENCH_COMMAND"
ARGV_ENV = "BUCKETWISE_BENCH_ARGV"
"""The ranks' arguments, as JSON: torchrun's own parser would take ``--nproc`` on the script's
command line for an abbreviation of its ``--nproc-per-node`` and refuse it."""

# --net socket / 2node: NCCL over TCP sockets on loopback (emulates multi-node Ethernet).
SOCKET_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"}
# --compile-cache off: no FX-graph / AOTAutograd cache hits between configs (comparable compile
# times whatever the config order); Triton's kernel binary cache still applies.
NO_CACHE_ENV = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}
# --compile-cache on: both caches on, in a fresh dir per job and config (bench_restart.py).
CACHE_ENV = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}
COMPILE_CACHES = ("off", "on")
PHASES = ("cold", "warm")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchArgs:
    nproc: int
    model: str
    configs: tuple[str, ...]
    steps: int
    warmup: int
    out: str
    backend: str
    bucket_cap_mb: float | None
    net: str
    device: str
    sizes: dict[str, int | None]
    profile_steps: int
    host_profile: int
    probe_iters: int
    timeline_config: str | None
    seed: int
    keep_traces: bool
    timeout_min: float
    compile_cache: str = "off"
    restart: bool = False
    """Run the job again over the same compile caches (``warm_first_step_s``)."""
    phase: str = "cold"
    """``warm``: this job is the restart (set by the launcher)."""
    cache_dir: str | None = None
    """The jobs' compile-cache root (``--compile-cache on``); default: a fresh one per job."""
    keep_cache: bool = False
    rounds: int = 1
    """Every config this many times, interleaved (A B C, A B C, ...): built and compiled once, in
    the first round; each later round times ``warmup`` + ``steps`` more steps of it."""

    def __post_init__(self) -> None:
        for name in ("nproc", "steps", "probe_iters", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        for name in ("warmup", "profile_steps", "host_profile"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.net not in NETS:
            raise ValueError(f"unknown --net {self.net!r}; use one of {', '.join(NETS)}")
        if self.net == "2node" and self.nproc != 2:
            raise ValueError(
                f"--net 2node runs 2 ranks, one per node: drop --nproc or pass --nproc 2, got {self.nproc}"
            )
        if self.device not in DEVICES:
            raise ValueError(f"unknown --device {self.device!r}; use one of {', '.join(DEVICES)}")
        if self.compile_cache not in COMPILE_CACHES:
            raise ValueError(f"unknown --compile-cache {self.compile_cache!r}; use one of {', '.join(COMPILE_CACHES)}")
        if self.restart and self.compile_cache == "off":
            raise ValueError("--restart measures a restart over warm compile caches: drop --compile-cache off")
        if self.phase not in PHASES:
            raise ValueError(f"unknown --phase {self.phase!r}; use one of {', '.join(PHASES)}")
        if self.rounds > 1 and self.restart:
            raise ValueError(
                f"--restart measures first steps in new processes; --rounds {self.rounds} times the same "
                "processes' steps again: run them as two jobs"
            )
        repeats = [c for c in self.configs if c != base_name(c)]
        if self.rounds > 1 and repeats:
            raise ValueError(
                f"--rounds {self.rounds} already runs every config {self.rounds} times: drop --repeat "
                f"({', '.join(base_name(c) for c in repeats)})"
            )
        if self.bucket_cap_mb is not None and not self.bucket_cap_mb > 0:
            raise ValueError(f"--bucket-cap-mb must be positive, got {self.bucket_cap_mb}")
        if self.timeout_min <= 0:
            raise ValueError(f"--timeout-min must be positive, got {self.timeout_min}")
        if not self.configs:
            raise ValueError(f"--configs is empty; known configs: {', '.join(CONFIGS)}")
        for config in self.configs:
            recipe_for(config)  # raises with the list of known configs
        dupes = sorted({c for c in self.configs if self.configs.count(c) > 1})
        if dupes:
            raise ValueError(f"config(s) listed twice: {', '.join(dupes)} (use --repeat CONFIG for a second run)")
        if self.timeline_config is not None and self.timeline_config not in self.configs:
            raise ValueError(f"--timeline-config {self.timeline_config!r} is not among --configs")
        bench_models.check_overrides(self.model, self.sizes)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bucketwise.benchmarks ddp",
        description="DDP training-step benchmark: eager vs torch.compile vs bucketwise.compile.",
        epilog=f"models: {', '.join(bench_models.MODELS)}; configs: {', '.join(CONFIGS)}",
    )
    p.add_argument("--nproc", type=int, default=None, help="ranks (default: GPUs on this host, or 2 on CPU)")
    p.add_argument("--model", default="gpt", help=f"one of {', '.join(bench_models.MODELS)} (default gpt)")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help="comma-separated config names")
    p.add_argument(
        "--repeat",
        action="append",
        default=[],
        metavar="CONFIG",
        help="run CONFIG a second time at the end, as CONFIG#2 (run-to-run spread); repeatable",
    )
    p.add_argument("--steps", type=int, default=30, help="timed steps (default 30; use >= 20)")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        metavar="N",
        help="run every config N times, interleaved (A B C, A B C, ...): each built and compiled once, "
        "later rounds time --warmup + --steps more steps of it; rows show the median of the round medians "
        "and their spread (default 1)",
    )
    p.add_argument("--warmup", type=int, default=5, help="untimed steps after the first (compiling) step")
    p.add_argument("--out", default=None, help="output directory (default benchmarks/results/<date>-<model>-<net>)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (aot_eager for CPU smoke tests)")
    p.add_argument("--bucket-cap-mb", type=float, default=None, help="DDP bucket_cap_mb (default: DDP's 25)")
    p.add_argument(
        "--net",
        default="default",
        help="default; socket (NCCL over TCP on loopback); 2node (two bucketwise launch agents, one GPU "
        "each, c10d rendezvous and NCCL over TCP on loopback: two nodes on Ethernet)",
    )
    p.add_argument("--device", default="auto", help="auto (CUDA if available), cuda or cpu")
    for flag in bench_models.SIZE_FLAGS:
        p.add_argument("--" + flag.replace("_", "-"), type=int, default=None, help="model size override")
    p.add_argument("--profile-steps", type=int, default=3, help="steps traced by torch.profiler (CUDA; 0: off)")
    p.add_argument(
        "--host-profile",
        type=int,
        default=0,
        metavar="STEPS",
        help="after timing, cProfile this many steps on rank 0 into OUT/host_profile/<config>.txt (0: off)",
    )
    p.add_argument("--probe-iters", type=int, default=5, help="allreduce bandwidth probe iterations")
    p.add_argument("--timeline-config", default=None, help="config of timeline.png (default: first bw config)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-traces", action="store_true", help="keep the raw profiler traces under OUT/traces")
    p.add_argument(
        "--compile-cache",
        default=None,
        help="off (default): no Inductor FX-graph/AOTAutograd cache; on (default with --restart): both "
        "caches, in a fresh dir per job and config (first steps are cold)",
    )
    p.add_argument(
        "--restart",
        action="store_true",
        help="then run the job again over the same compile caches: warm_first_step_s per config",
    )
    p.add_argument(
        "--cache-dir", default=None, help="compile-cache root (--compile-cache on; default: a fresh temporary dir)"
    )
    p.add_argument("--keep-cache", action="store_true", help="keep the compile-cache root after the job")
    p.add_argument("--phase", default="cold", help=argparse.SUPPRESS)
    p.add_argument("--timeout-min", type=float, default=15.0, help="process-group timeout in minutes")
    return p


def parse(argv: list[str]) -> BenchArgs:
    p = parser()
    ns = p.parse_args(argv)
    configs = [c.strip() for c in ns.configs.split(",") if c.strip()]
    for config in ns.repeat:
        if config not in configs:
            p.error(f"--repeat {config!r} is not among --configs")
        configs.append(f"{base_name(config)}#2")
    device = ns.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    nproc = ns.nproc if ns.nproc is not None else (2 if ns.net == "2node" else _default_nproc(device))
    out = ns.out or default_out(ns.model, ns.net)
    try:
        return BenchArgs(
            nproc=nproc,
            model=ns.model,
            configs=tuple(configs),
            steps=ns.steps,
            warmup=ns.warmup,
            out=os.path.abspath(out),
            backend=ns.backend,
            bucket_cap_mb=ns.bucket_cap_mb,
            net=ns.net,
            device=device,
            sizes={f: getattr(ns, f) for f in bench_models.SIZE_FLAGS},
            profile_steps=ns.profile_steps,
            host_profile=ns.host_profile,
            probe_iters=ns.probe_iters,
            timeline_config=ns.timeline_config,
            seed=ns.seed,
            keep_traces=ns.keep_traces,
            timeout_min=ns.timeout_min,
            compile_cache=ns.compile_cache or ("on" if ns.restart else "off"),
            restart=ns.restart,
            phase=ns.phase,
            cache_dir=os.path.abspath(ns.cache_dir) if ns.cache_dir else None,
            keep_cache=ns.keep_cache,
            rounds=ns.rounds,
        )
    except ValueError as exc:
        p.error(str(exc))
        raise  # unreachable: p.error exits


def default_out(model: str, net: str) -> str:
    """``results/<YYYYmmdd-HHMM>-<model>-<net>``, plus ``-gpus<CUDA_VISIBLE_DEVICES>`` when that is
    set, plus ``-2``, ``-3``, ... when the directory exists (back-to-back or concurrent runs).
    Under torchrun (``RANK`` set) without the suffix: every rank must compute the same path."""
    name = f"{datetime.datetime.now():%Y%m%d-%H%M}-{model}-{net}"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        name += "-gpus" + re.sub(r"[^A-Za-z0-9,]+", "_", visible)
    path, n = RESULTS_ROOT / name, 2
    while "RANK" not in os.environ and path.exists():
        path, n = RESULTS_ROOT / f"{name}-{n}", n + 1
    return str(path)


def _default_nproc(device: str) -> int:
    if device == "cuda":
        import torch

        return max(1, torch.cuda.device_count())
    return 2


def job_env(args: BenchArgs) -> dict[str, str]:
    env = dict(ALWAYS_ENV)
    if args.net in ("socket", "2node"):
        env.update(SOCKET_ENV)
    env.update(NO_CACHE_ENV if args.compile_cache == "off" else CACHE_ENV)
    return env


def cache_env_errors(args: BenchArgs, environ: Mapping[str, str]) -> str | None:
    """Why ``environ`` (a rank's environment) does not turn the compile caches on or off as
    ``--compile-cache`` asks, or ``None``: torch reads the variables once, when it is imported
    (unset: torch's default, on), so a rank started under torchrun directly needs them there."""
    wanted = CACHE_ENV if args.compile_cache == "on" else NO_CACHE_ENV
    if all(environ.get(k, "1") == v for k, v in wanted.items()):
        return None
    return (
        f"--compile-cache {args.compile_cache} needs {' '.join(f'{k}={v}' for k, v in wanted.items())} in the "
        "environment of the ranks (torch reads them when it is imported): start `python -m bucketwise.benchmarks "
        "ddp` without torchrun, which sets them, or set them for torchrun"
    )


def check_launch(args: BenchArgs) -> None:
    """Errors that are cheaper to report before starting the ranks."""
    import torch

    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("ddp: error: --device cuda but CUDA is not available")
        if args.nproc > torch.cuda.device_count():
            raise SystemExit(
                f"ddp: error: --nproc {args.nproc} > {torch.cuda.device_count()} visible GPUs (one GPU per rank)"
            )
    known = sorted(torch.compiler.list_backends(exclude_tags=()))
    if args.backend not in known:
        raise SystemExit(f"ddp: error: unknown --backend {args.backend!r}; known: {', '.join(known)}")


def rank_argv(argv: list[str]) -> list[str]:
    """The arguments of a rank: from ``$BUCKETWISE_BENCH_ARGV`` when relaunched, else ``argv``."""
    packed = os.environ.get(ARGV_ENV)
    return list(json.loads(packed)) if packed else argv


def relaunch(args: BenchArgs, argv: list[str]) -> None:
    """Replace this process with ``python -m torch.distributed.run --standalone`` running this
    script; the ranks get the same arguments (plus the resolved ``--out``, ``--device`` and
    ``--nproc``) through ``$BUCKETWISE_BENCH_ARGV``."""
    check_launch(args)
    env = dict(os.environ)
    env.update(job_env(args))
    env[COMMAND_ENV] = shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    extra = ["--out", args.out, "--device", args.device, "--nproc", str(args.nproc)]
    cache_root = None
    if args.compile_cache == "on":
        from bucketwise.benchmarks.ddp.restart import new_cache_root

        cache_root = args.cache_dir or new_cache_root()
        extra += ["--cache-dir", cache_root]
    env[ARGV_ENV] = json.dumps([*argv, *extra])
    script = str(Path(__file__).resolve().parent / "bench.py")
    job = launchers(script, args)
    for p in job:
        print(f"launching: {' '.join(f'{k}={v} ' for k, v in p.env.items())}{shlex.join(p.argv[1:])}", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    if cache_root is not None:
        # Compile caches: wait for the job (and its restart), then remove the cache root we made.
        from bucketwise.benchmarks.ddp.restart import run_jobs

        sys.exit(
            run_jobs(job, env, cache_root, restart=args.restart, keep=args.keep_cache or args.cache_dir is not None)
        )
    sys.exit(procs.run(job, env=env).code)


def launchers(script: str, args: BenchArgs) -> list[procs.Proc]:
    """The launcher processes of one job: a torchrun job, or two node agents (``--net 2node``)."""
    if args.net != "2node":
        return [procs.torchrun(script, nproc=args.nproc)]
    if args.nproc != 2:
        raise ValueError(f"--net 2node runs 2 ranks (one per node), got --nproc {args.nproc}")
    return procs.node_agents(script, out=args.out, device=args.device)
