"""The ``bucketwise`` command: ``launch``, ``doctor``, ``stats``, ``demo`` and ``--version``
(each subcommand's help and description below say what it does)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import Any, Callable, Sequence

from ..compiler import doctor
from ..stats import job_stats
from ..stats.report_data import ReportData
from . import failures, launcher, stats, stopping
from .demo import add_demo_arguments

DOCTOR_PROFILE_STEPS = 3
"""Training steps ``bucketwise doctor`` profiles when not told (host-bound or not)."""

_DESCRIPTION = """\
Distributed-aware torch.compile for DistributedDataParallel: launch jobs through torchrun and
read the per-bucket compile statistics of bucketwise.compile.
"""

_EPILOG = """\
examples:
  bucketwise launch --standalone --nproc-per-node 2 train.py --lr 3e-4
  bucketwise launch --standalone --nproc-per-node 2 --profile-steps 5 train.py
  bucketwise launch --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 train.py
  bucketwise stats bucketwise-runs/20250101-120000
  bucketwise stats bucketwise-runs/20250101-120000/rank0.json --json
  bucketwise demo --backend aot_eager --steps 4
"""

_LAUNCH_DESCRIPTION = """\
Run SCRIPT on every rank through torch.distributed.run (torchrun), with every option below
passed to torchrun unchanged (spell options in full: no abbreviations). Each rank's
bucketwise.compile results write rank<R>.json into --stats-dir; when the job ends, the
per-bucket table merged across ranks is printed and ranks whose bucket plans differ from
rank 0's are named. With several nodes (one launch per node), rank 0 gathers every rank's
files through the job's own store: the launch on rank 0's node prints the table of the whole
job, the others say where it is. The exit code is the job's.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bucketwise",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_torchrun_command(
        sub,
        "launch",
        _cmd_launch,
        help="run a script on every rank through torchrun, then print the merged per-bucket table",
        description=_LAUNCH_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="bucketwise launch [-h] [torchrun options] [--stats-dir DIR] [--profile-steps N [--profile-warmup W]] "
        "[--compile-artifacts DIR] SCRIPT [ARGS ...]",
    )
    _add_torchrun_command(
        sub,
        "doctor",
        lambda args, raw: _cmd_launch(args, raw, doctor_dir="doctor"),
        help="run a script like launch, checking every compiled segment through eager -> aot_eager -> inductor",
        description="Run SCRIPT like `bucketwise launch`. The first real call of every compiled "
        "segment also recompiles a copy of it through eager -> aot_eager -> inductor "
        "(up to the backend in use; $BUCKETWISE_DOCTOR_LADDER overrides) and compares "
        "each stage's outputs with the uncompiled segment. Prints, per segment, the "
        "first stage that fails or diverges, with the error; the segment's graph is "
        "saved under STATS_DIR/doctor/. It also profiles a few training steps "
        f"(--profile-steps, {DOCTOR_PROFILE_STEPS} unless given) and says which ranks' steps "
        "are bound by the host, and what to try.",
        usage="bucketwise doctor [-h] [torchrun options] [--stats-dir DIR] [--profile-steps N] SCRIPT [ARGS ...]",
    )
    _add_stats(sub)
    _add_demo(sub)
    return parser


def _version() -> str:
    from .. import __version__

    return __version__


def _add_torchrun_command(sub, name: str, func: Callable[..., int], **kwargs: Any) -> None:
    p = sub.add_parser(name, parents=[launcher.launch_parser()], add_help=False, allow_abbrev=False, **kwargs)
    p.set_defaults(func=func, parser=p)


def _add_stats(sub) -> None:
    p = sub.add_parser(
        "stats",
        help="print the per-bucket table of a run folder (rank*.json) or one rank file",
        description="Print the per-bucket compile table of a finished run, merged across ranks: per "
        "(graph, segment) params, MiB, ops, min/median/max compile seconds over ranks, "
        "backend, fallbacks; and which ranks' bucket plans differ from rank 0's.",
    )
    p.add_argument(
        "path",
        metavar="PATH",
        nargs="+",
        help="a run folder holding rank<R>.json files, or one rank file; several are merged (each node's "
        "folder of a job whose rank 0 gathered nothing, say)",
    )
    p.add_argument("--json", action="store_true", help="print the merged statistics as JSON instead")
    p.set_defaults(func=_cmd_stats, parser=p)


def _add_demo(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="train a small GPT on 2 ranks, bucketwise-compiled vs eager DDP",
        description="Launch N ranks (torchrun --standalone; gloo on CPU, NCCL with one GPU per rank "
        "when enough GPUs are visible) that train a small GPT with DDP, compiled by "
        "bucketwise, next to an identical eager DDP copy. Prints both losses and the "
        "compiled step time per step, fails if the losses differ, and prints rank 0's "
        "per-bucket report and alignment.",
    )
    add_demo_arguments(p)
    p.add_argument("--nproc", type=launcher.positive_int, default=2, help="number of ranks (default: 2)")
    p.add_argument("--stats-dir", metavar="DIR", help=launcher.STATS_DIR_HELP)
    p.set_defaults(func=_cmd_demo, parser=p)


# -- commands ------------------------------------------------------------------------------


def _cmd_launch(args: argparse.Namespace, raw: list[str], doctor_dir: str | None = None) -> int:
    command = "doctor" if doctor_dir is not None else "launch"
    if args.training_script is None:
        args.parser.error(
            "missing SCRIPT: give the training script to run, e.g. "
            f"`bucketwise {command} --standalone --nproc-per-node 2 train.py`"
        )
    problem = launcher.script_problem(args)
    if problem is not None:  # before the stats folder and any rank: each would fail to open it
        args.parser.error(problem)
    options, script = launcher.split_at_script(args.parser, raw)
    stats_dir = _prepare_stats_dir(args)
    print(f"bucketwise: stats folder {stats_dir}", file=sys.stderr, flush=True)
    for option in launcher.BUCKETWISE_OPTIONS:
        options = launcher.strip_option(options, option)
    logs = failures.log_options(options, stats_dir)
    if doctor_dir is not None and args.profile_steps is None:
        args.profile_steps = DOCTOR_PROFILE_STEPS
    extra = {**launcher.profile_env(args), **launcher.compile_artifacts_env(args)}
    if doctor_dir is not None:
        extra[doctor.DOCTOR_ENV] = os.path.join(stats_dir, "doctor")
    code = launcher.run_torchrun(logs + options + script, stats_dir, extra)
    launcher.summarize(stats_dir)
    if doctor_dir is not None:
        eager = stats.eager_summary(stats_dir)
        print(
            "\n".join(
                doctor.summarize(os.path.join(stats_dir, "doctor"))
                + eager
                + ([] if eager else ["bucketwise doctor: every compiled object ran its compiled graphs"])
                + stats.host_bound_lines(stats_dir, args.profile_steps)
            )
        )
    if code != 0:
        found = failures.find_failures(os.path.join(stats_dir, "logs")) if logs else []
        print("\n".join(failures.describe(found, code)), file=sys.stderr)
    return code


def _cmd_stats(args: argparse.Namespace, raw: list[str]) -> int:
    warn = lambda msg: print(f"bucketwise stats: warning: {msg}", file=sys.stderr)  # noqa: E731
    try:
        reports = stats.load_reports(args.path, warn)
    except stats.StatsError as e:
        args.parser.error(f"PATH {e}")
    if not reports:
        print(f"bucketwise stats: no readable rank files in {' '.join(args.path)}", file=sys.stderr)
        return 1
    merged = stats.merge(reports)
    if args.json:
        print(json.dumps(merged, indent=1))
        return 0
    print(_single_rank_table(reports[0], merged) if len(reports) == 1 else stats.format_merged(merged))
    lines = job_stats.job_lines(job_stats.read_job_file(args.path[0])) if len(args.path) == 1 else []
    for path in args.path:
        lines += stats.runtime_lines(path, warn)
    if lines:
        print("\n".join(lines))
    return 0


def _single_rank_table(report: ReportData, merged: dict) -> str:
    from ..stats.report_format import format_table

    head = f"rank {report.rank} of {report.world_size}"
    try:
        return f"{head}\n{format_table(report)}"
    except (KeyError, TypeError):  # an older or partial file: the merged table needs fewer keys
        return f"{head}\n{stats.format_merged(merged)}"


def _cmd_demo(args: argparse.Namespace, raw: list[str]) -> int:
    _check_backend(args)
    stats_dir = _prepare_stats_dir(args)
    worker = [
        "--backend",
        args.backend,
        "--steps",
        str(args.steps),
        "--strategy",
        args.strategy,
        "--bucket-cap-mb",
        str(args.bucket_cap_mb),
    ]
    if args.rtol is not None:
        worker += ["--rtol", str(args.rtol)]
    torchrun = ["--standalone", "--nproc-per-node", str(args.nproc), "-m", "bucketwise.launch.demo", *worker]
    code = launcher.run_torchrun(torchrun, stats_dir)
    launcher.summarize(stats_dir, table=False)
    if code != 0:
        print(f"bucketwise demo: FAILED (exit code {code})", file=sys.stderr)
    return code


def _check_backend(args: argparse.Namespace) -> None:
    import torch

    known = sorted(torch.compiler.list_backends(exclude_tags=()))
    if args.backend not in known:
        args.parser.error(f"--backend {args.backend!r}: unknown; choose one of {', '.join(known)}")


def _prepare_stats_dir(args: argparse.Namespace) -> str:
    try:
        return launcher.prepare_stats_dir(args.stats_dir or launcher.default_stats_dir())
    except (ValueError, OSError) as e:
        args.parser.error(str(e))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    # The top-level parser has no options taking values, so argv[0] is the subcommand.
    raw = argv[argv.index(args.command) + 1 :]
    try:
        code = args.func(args, raw)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
    except BrokenPipeError:
        return _reader_gone()
    except stopping.Interrupted as stopped:  # every rank is stopped; the line said so
        return stopped.code
    except KeyboardInterrupt:  # Ctrl-C outside a job (reading the stats)
        print("bucketwise: interrupted (Ctrl-C)", file=sys.stderr)
        return 128 + signal.SIGINT
    return code


def _reader_gone() -> int:
    """The reader of stdout went away (``bucketwise stats --json DIR | head``): stop quietly,
    as a shell tool does, instead of a traceback. stdout goes to /dev/null so the interpreter's
    last flush cannot raise again; the exit code is a shell's for SIGPIPE (128 + 13)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
