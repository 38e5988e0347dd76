"""Running a job through torchrun with ``BUCKETWISE_STATS_DIR`` set, and summarizing its rank files."""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from typing import Sequence, TextIO

from ..compiler.artifacts import ENV as ARTIFACTS_ENV
from ..stats import job_stats
from ..stats.profiling import AUTO_WARMUP_MAX, AUTO_WARMUP_MIN, PROFILE_STEPS_ENV, PROFILE_WARMUP_ENV
from ..stats.rank_file import STATS_DIR_ENV
from . import stats, stopping

DEFAULT_RUNS_DIR = "bucketwise-runs"
STATS_DIR_HELP = (
    f"folder for the ranks' rank<R>.json files (default: ./{DEFAULT_RUNS_DIR}/<YYYYmmdd-HHMMSS>); "
    "must not already hold rank files"
)
PROFILE_STEPS_HELP = (
    "profile N training steps of every rank after a warm-up: per-bucket communication time "
    "(overlapped with compute, exposed) and bytes on the wire are printed at the end; each rank's "
    "Chrome trace and timeline plot go into the stats folder"
)
PROFILE_WARMUP_HELP = (
    f"training steps before the profile starts (default: auto: {AUTO_WARMUP_MIN} steps, then until a "
    f"step compiles nothing new, {AUTO_WARMUP_MAX} at most)"
)
BUCKETWISE_OPTIONS = ("--stats-dir", "--profile-steps", "--profile-warmup", "--compile-artifacts")


def default_stats_dir(now: datetime.datetime | None = None) -> str:
    """``./bucketwise-runs/<YYYYmmdd-HHMMSS>``, with ``-2``, ``-3``... if that one exists."""
    stamp = (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
    base = os.path.join(DEFAULT_RUNS_DIR, stamp)
    path, n = base, 1
    while os.path.exists(path):
        n += 1
        path = f"{base}-{n}"
    return path


def prepare_stats_dir(path: str) -> str:
    """Create the stats folder; refuse one that already holds rank files (they would mix)."""
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--stats-dir {path}: exists and is not a folder")
    if os.path.isdir(path) and stats.rank_files(path):
        raise ValueError(
            f"--stats-dir {path}: already holds rank*.json files of an earlier run; "
            "choose another folder or delete them"
        )
    os.makedirs(path, exist_ok=True)
    return path


def launch_parser() -> argparse.ArgumentParser:
    """torchrun's own parser plus ours; SCRIPT optional so that a missing one gets a clear message."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    group = parser.add_argument_group("bucketwise options")
    group.add_argument("--stats-dir", metavar="DIR", help=STATS_DIR_HELP)
    group.add_argument("--profile-steps", metavar="N", type=positive_int, help=PROFILE_STEPS_HELP)
    group.add_argument("--profile-warmup", metavar="W", type=_warmup, default="auto", help=PROFILE_WARMUP_HELP)
    group.add_argument("--compile-artifacts", metavar="DIR", help=COMPILE_ARTIFACTS_HELP)
    for action in parser._actions:  # argparse has no public accessor
        if action.dest == "training_script":
            action.required, action.metavar = False, "SCRIPT"
            action.help = "the training script (or module, with -m) every rank runs"
        elif action.dest == "training_script_args":
            action.required, action.metavar, action.help = False, "ARGS", "arguments for SCRIPT"
    return parser


def script_problem(args: argparse.Namespace) -> str | None:
    """Why SCRIPT cannot start on any rank, as an error message, or ``None``. As torchrun reads it,
    SCRIPT is a file path (relative to the current folder) unless ``-m``/``--module`` (a module) or
    ``--no-python`` (a program on PATH) is given; ``-`` (the script on stdin) is left to python."""
    script = args.training_script
    if script is None or args.module or args.no_python or (script == "-" and not args.run_path):
        return None
    if os.path.exists(script):
        return None
    where = f" (no such file: {os.path.abspath(script)})" if not os.path.isabs(script) else ": no such file"
    return (
        f"SCRIPT {script}{where}; no rank was started. Give the training script's path, absolute or "
        "relative to the current folder; to run a module instead, put -m (--module) before its name "
        "(--no-python before a program's)"
    )


COMPILE_ARTIFACTS_HELP = (
    "keep each rank's compiled artifacts in DIR/rank{R}.bin: loaded into the local compile caches when the "
    "model is compiled, saved after its first step, so a restart on a machine with an empty cache starts warm "
    "(sets BUCKETWISE_COMPILE_ARTIFACTS; keep DIR next to your checkpoint)"
)


def compile_artifacts_env(args: argparse.Namespace) -> dict[str, str]:
    """Where the ranks keep their compiled artifacts (NOTE [compile artifacts])."""
    if args.compile_artifacts is None:
        return {}
    return {ARTIFACTS_ENV: os.path.abspath(args.compile_artifacts)}


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _warmup(text: str) -> str:
    if text != "auto" and not (text.isdigit() and int(text) >= 0):
        raise argparse.ArgumentTypeError(f"expected 'auto' or an integer >= 0, got {text!r}")
    return text


def profile_env(args: argparse.Namespace) -> dict[str, str]:
    """What the ranks need to profile themselves (NOTE [profiling from the environment])."""
    if args.profile_steps is None:
        return {}
    return {PROFILE_STEPS_ENV: str(args.profile_steps), PROFILE_WARMUP_ENV: args.profile_warmup}


def split_at_script(parser: argparse.ArgumentParser, args: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(launcher options, [SCRIPT, *script args])``; ``--`` before SCRIPT stays with the options."""
    options = parser._option_string_actions  # argparse has no public accessor
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            return list(args[: i + 1]), list(args[i + 1 :])
        if not a.startswith("-") or a == "-":
            return list(args[:i]), list(args[i:])
        action = options.get(a)
        # "--opt=value" and "-rVALUE" carry their value; a bare option with nargs None takes the next.
        i += 2 if action is not None and action.nargs is None else 1
    return list(args), []


def strip_option(args: Sequence[str], option: str) -> list[str]:
    """``args`` without ``option VALUE`` / ``option=VALUE`` (every occurrence)."""
    out: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
        elif a == option:
            skip = True
        elif not a.startswith(option + "="):
            out.append(a)
    return out


def torchrun_command(torchrun_args: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *torchrun_args]


def run_torchrun(torchrun_args: Sequence[str], stats_dir: str, extra_env: dict[str, str] | None = None) -> int:
    """torchrun's exit code; Ctrl-C raises :class:`stopping.Interrupted` (NOTE [stopping a job])."""
    env = dict(os.environ, **{STATS_DIR_ENV: stats_dir}, **(extra_env or {}))
    return stopping.run(torchrun_command(torchrun_args), env, logs=os.path.join(stats_dir, "logs"))


def summarize(stats_dir: str, *, table: bool = True, out: TextIO | None = None) -> bool:
    """Print a finished run's merged table (``table=False``: the plan check only) or where another
    node's folder has it (NOTE [job-wide stats]). False when no rank wrote a report."""
    out = out or sys.stdout
    job = job_stats.read_job_file(stats_dir)
    if job_stats.is_elsewhere(stats_dir, job):
        print("\n" + "\n".join(stats.pointer_lines(stats_dir, job)), file=out, flush=True)
        return True
    warn = lambda msg: print(f"bucketwise: warning: {msg}", file=sys.stderr)  # noqa: E731
    reports = stats.load_reports(stats_dir, warn)
    if not reports:
        print(
            f"bucketwise: no rank files in {stats_dir} (no rank called a bucketwise-compiled "
            "model, or the job failed before the first compile)",
            file=out,
        )
        return False
    merged = stats.merge(reports)
    print(f"\nbucketwise: per-bucket compile stats, {len(reports)} rank(s), from {stats_dir}", file=out)
    if table:
        print(stats.format_merged(merged), file=out)
        print("\n".join(stats.runtime_lines(stats_dir, warn)), file=out)
    else:
        print("\n".join([stats.totals_line(merged), *stats.plan_check_lines(merged)]), file=out)
    for line in job_stats.job_lines(job):
        print(line, file=out)
    others = stats.other_objects(stats_dir)
    if others:
        hint = ", ".join(f"bucketwise stats {os.path.join(stats_dir, d)}" for d in others)
        print(f"bucketwise: {len(others)} more compiled object(s) reported per rank: {hint}", file=out)
    out.flush()
    return True
