"""Profiling a user's own training steps (``bucketwise.profile``, ``bucketwise launch --profile-steps``):
``torch.profiler`` (recording shapes: gloo's ranges carry sizes only then) over training steps of
one compiled object (each a ``bucketwise.step`` range), the trace analysed per bucket.

NOTE [profiling from the environment]: ``bucketwise launch --profile-steps N`` sets
``$BUCKETWISE_PROFILE_STEPS`` (and ``$BUCKETWISE_PROFILE_WARMUP``) for every rank. The first
compiled object to take a training step claims the profile, from the start of a step after the
warm-up to the start of the N-th step after it (or interpreter exit): N whole steps, no compiles.
The automatic warm-up skips 3 steps (bucket rebuild, CUDA graph recording), then every step that
compiled a new graph, up to 20. The view goes to the stats folder and through the job's store to
rank 0 (NOTE [job-wide stats]), so the launcher prints it for every rank.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import sys
import tempfile
import time
import weakref
from typing import Any

import torch

from ..distributed.at_exit import at_exit
from . import job_stats
from . import trace_analysis as ta
from .files import atomic_write_json
from .rank_file import STATS_DIR_ENV, rank_and_world
from .report import Report, report
from .runtime_view import GPU_BOUND_PREFIX, HOST_BOUND_PREFIX, STEP_MARK, RuntimeView, analyze, plot_timeline

log = logging.getLogger(__name__)

PROFILE_STEPS_ENV = "BUCKETWISE_PROFILE_STEPS"
PROFILE_WARMUP_ENV = "BUCKETWISE_PROFILE_WARMUP"
DEFAULT_OUT_DIR = "bucketwise-profile"
AUTO_WARMUP_MIN = 3
AUTO_WARMUP_MAX = 20


class Profile:
    """Context manager of :func:`bucketwise.profile`; ``view`` holds the result after the block."""

    def __init__(self, compiled: Any, *, out_dir: str | os.PathLike | None = None, plot: bool = True) -> None:
        try:
            self._report = report(compiled)
        except TypeError:
            raise TypeError(
                f"profile(compiled): expects an object returned by bucketwise.compile, got {type(compiled).__name__}"
            ) from None
        if out_dir is not None and not isinstance(out_dir, (str, os.PathLike)):
            raise TypeError(f"out_dir: expected a folder path (str or os.PathLike), got {type(out_dir).__name__}")
        if not isinstance(plot, bool):
            raise TypeError(f"plot: expected True or False, got {plot!r}")
        self.compiled = compiled
        self.out_dir = os.path.abspath(
            out_dir if out_dir is not None else os.environ.get(STATS_DIR_ENV) or DEFAULT_OUT_DIR
        )
        self.plot = plot
        self.steps = 0
        self.view: RuntimeView | None = None
        self._prof: Any = None
        self._t0 = (0.0, 0.0)
        self._marks: list[tuple[float, float]] = []
        """The clocks (``perf_counter()``, ``process_time()``) at the first and the latest step start."""

    def __enter__(self) -> Profile:
        self._start()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self._stop()
        else:
            self._halt()

    def table(self) -> str:
        if self.view is None:
            raise RuntimeError("profile: no view yet; the `with` block has not ended")
        return self.view.table()

    # -- the profiler ------------------------------------------------------------------------

    def _start(self) -> None:
        global _running
        if _running is not None:
            raise RuntimeError(
                "profile: another bucketwise profile is running in this process (torch.profiler "
                f"runs one at a time); end it first{_ENV_HINT if _running is _auto_session() else ''}"
            )
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._prof = profile(activities=activities, record_shapes=True)
        _sync()
        with _without_kineto_markers():
            self._prof.start()
        self._t0 = _clocks()
        _running = self

    def _mark_step(self) -> None:
        self.steps += 1
        now = _clocks()
        self._marks = [self._marks[0] if self._marks else now, now]
        with torch.profiler.record_function(STEP_MARK):
            pass

    def _halt(self) -> tuple[float, float]:
        global _running
        _sync()
        end = _clocks()
        with _without_kineto_markers():
            self._prof.stop()
        _running = None
        return end

    def _per_step_ms(self, end: tuple[float, float], last_step_open: bool) -> tuple[float, float]:
        """Wall and CPU time per step from the first step's start to ``end`` (to the last step's
        start when a profile is closed at exit)."""
        if not self._marks:
            start, stop, n = self._t0, end, 1
        else:
            first, last = self._marks
            start, stop, n = (
                (first, last, self.steps - 1) if last_step_open and self.steps > 1 else (first, end, self.steps)
            )
        wall, cpu = ((b - a) * 1e3 / n for a, b in zip(start, stop))
        return wall, cpu

    def _stop(self, notes: tuple[str, ...] = (), *, last_step_open: bool = False) -> RuntimeView:
        """Stop profiling; write the trace, the view (``runtime-rank<R>.json``) and the plot."""
        end = self._halt()
        rank = rank_and_world()[0]
        os.makedirs(self.out_dir, exist_ok=True)
        trace = os.path.join(self.out_dir, f"runtime-rank{rank}.trace.json")
        self._prof.export_chrome_trace(trace)
        steps = max(1, self.steps)
        step_ms, cpu_ms = self._per_step_ms(end, last_step_open)
        view = analyze(
            ta.load_trace(trace),
            self._report.to_dict(),
            steps=steps,
            step_ms=step_ms,
            host=socket.gethostname(),
            cpu_ms=cpu_ms,
            memory_mib=_cuda_memory_mib(),
        )
        view.trace_path = trace
        view.notes.extend(notes)
        verdicts = [n for n in view.notes if n.startswith((HOST_BOUND_PREFIX, GPU_BOUND_PREFIX))]
        if verdicts:
            # The report says them too: its table, the rank file, `bucketwise stats` and `doctor`.
            for note in verdicts:
                self._report.note(f"profiled steps: {note}")
            self._report.write_rank_file()
        if self.steps == 0:
            view.notes.append(
                "no training step of the compiled object ran while profiling: figures are for the whole profiled time"
            )
        if self.plot:
            png = os.path.join(self.out_dir, f"runtime-rank{rank}.png")
            if plot_timeline(view.timeline, png, f"{view.target}, rank {rank}: {view.timeline['window']}"):
                view.plot_path = png
            else:
                view.notes.append("no timeline plot: matplotlib is not installed (pip install matplotlib)")
        data = view.to_dict()
        name = f"runtime-rank{rank}.json"
        atomic_write_json(os.path.join(self.out_dir, name), data)
        stats_dir = os.environ.get(STATS_DIR_ENV)
        if stats_dir and os.path.abspath(stats_dir) == self.out_dir:
            job_stats.publish(stats_dir, name, data)
        self.view = view
        return view


# NOTE [a step's CPU time]: on a GPU, autograd runs the backward's host work on a thread of its
# own while the calling thread waits, so a step's CPU time is the whole process's (all threads,
# the profiler's too): near the step's wall time, the host is working, not waiting.


def _clocks() -> tuple[float, float]:
    """Wall clock and the process's CPU time, seconds (NOTE [a step's CPU time])."""
    return time.perf_counter(), time.process_time()


def _cuda_memory_mib() -> tuple[float, float] | None:
    """The caching allocator's peak allocated and reserved now, MiB (``None`` without CUDA); the
    peak is not reset, leaving the user's own reading intact."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    return torch.cuda.max_memory_allocated() / 2**20, torch.cuda.memory_reserved() / 2**20


_ENV_HINT = (
    f" (${PROFILE_STEPS_ENV} is set: `bucketwise launch --profile-steps` profiles this job already; "
    "drop one of the two)"
)

_running: Profile | None = None
"""The profile now running in this process (torch.profiler is process-wide)."""


def profile(compiled: Any, *, out_dir: str | os.PathLike | None = None, plot: bool = True) -> Profile:
    """Profile the training steps run inside a ``with`` block, per gradient bucket.

    ``compiled`` is an object returned by :func:`bucketwise.compile`; every call of it with
    gradients enabled that synchronises gradients counts as a step. When the block ends, the
    returned object's ``view`` (a :class:`RuntimeView`) holds per bucket: communication time
    per step, the part of it overlapped with compute, the exposed rest, and the bytes each rank
    sent; ``view.table()`` prints them. Written into ``out_dir`` (default: ``$BUCKETWISE_STATS_DIR``,
    else ``./bucketwise-profile``): the Chrome trace ``runtime-rank<R>.trace.json``, the view
    ``runtime-rank<R>.json`` and, with matplotlib installed and ``plot=True``, the last step's
    timeline ``runtime-rank<R>.png``. On CUDA the collectives are NCCL kernels; on CPU (gloo),
    gloo's ranges on its host threads. Every rank profiles its own steps: enter the block on
    every rank (the steps hold collectives).
    """
    return Profile(compiled, out_dir=out_dir, plot=plot)


_KINETO_MARKER = re.compile(rb"^USDT:.*\] profiler_(start|stop)\s*$")


@contextlib.contextmanager
def _without_kineto_markers() -> Any:
    """Hold back fd 2 within, writing it out on leaving minus kineto's start/stop markers.

    NOTE [kineto's markers]: kineto prints ``USDT:... profiler_start``/``profiler_stop`` lines at a
    log level above its errors (so ``KINETO_LOG_LEVEL`` cannot drop them alone), once per rank under
    ``bucketwise launch``. Only the start and stop calls are wrapped; other output still comes out."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no stderr to hold back
        yield
        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = b"".join(line for line in held.read().splitlines(keepends=True) if not _KINETO_MARKER.match(line))
            while kept:
                kept = kept[os.write(2, kept) :]


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


# -- from the environment (NOTE [profiling from the environment]) ----------------------------


class _AutoProfile:
    """The profile ``$BUCKETWISE_PROFILE_STEPS`` asks for, of the first compiled object that
    takes a training step."""

    def __init__(self, steps: int, warmup: int | None) -> None:
        self.steps = steps
        self.warmup = warmup
        self.owner: Any = None
        self.calls = 0
        self.graphs_before: int | None = None
        self.session: Profile | None = None
        self.first_step = 0
        self.done = False

    def on_step(self, compiled: Any, rep: Report) -> None:
        if self.done:
            return
        if self.owner is None:
            self.owner = weakref.ref(compiled)
        elif self.owner() is not compiled:
            return
        self.calls += 1
        if self.session is None and self._warm(rep):
            self._start(compiled)
        elif self.session is not None and self.session.steps >= self.steps:
            self.finish()
        self.graphs_before = len(rep.graphs)

    def _warm(self, rep: Report) -> bool:
        done = self.calls - 1
        if self.warmup is not None:
            return done >= self.warmup
        compiled_nothing = self.graphs_before is not None and len(rep.graphs) == self.graphs_before
        return done >= AUTO_WARMUP_MAX or (done >= AUTO_WARMUP_MIN and compiled_nothing)

    def _start(self, compiled: Any) -> None:
        out_dir = os.environ.get(STATS_DIR_ENV) or DEFAULT_OUT_DIR
        try:
            self.session = Profile(compiled, out_dir=out_dir)
            self.session._start()
        except RuntimeError as exc:
            log.warning("bucketwise: $%s: not profiling: %s", PROFILE_STEPS_ENV, exc)
            self.session, self.done = None, True
            return
        self.first_step = self.calls
        at_exit("profile", stop_at_exit)

    def finish(self, *, at_exit: bool = False) -> None:
        session, self.session, self.done = self.session, None, True
        if session is None:
            return
        short = session.steps < self.steps
        notes = (f"the job ended after {session.steps} of the {self.steps} steps asked for",) if short else ()
        view = session._stop(notes, last_step_open=at_exit)
        last = self.first_step + session.steps - 1
        if view.rank == 0:
            where = "printed at the end of the job" if os.environ.get(STATS_DIR_ENV) else f"in {session.out_dir}"
            print(
                f"bucketwise: profiled steps {self.first_step}-{last} of {view.target} (per-bucket table {where})",
                file=sys.stderr,
                flush=True,
            )
            if not os.environ.get(STATS_DIR_ENV):
                print(view.table(), flush=True)


_auto: _AutoProfile | None = None
"""This process's profile from the environment, once a training step has read it."""


def _auto_profile() -> _AutoProfile | None:
    global _auto
    if _auto is None:
        steps = os.environ.get(PROFILE_STEPS_ENV)
        if steps:
            _auto = _AutoProfile(_env_int(PROFILE_STEPS_ENV, steps, minimum=1), _warmup_from_env())
    return _auto


def _auto_session() -> Profile | None:
    return _auto.session if _auto is not None else None


def _warmup_from_env() -> int | None:
    text = os.environ.get(PROFILE_WARMUP_ENV, "auto")
    return None if text == "auto" else _env_int(PROFILE_WARMUP_ENV, text, minimum=0)


def _env_int(name: str, text: str, *, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ValueError(
            f"${name}={text!r}: expected an integer >= {minimum}"
            + (" or 'auto'" if name == PROFILE_WARMUP_ENV else "")
            + "; set it right or unset it"
        )
    return value


def on_call(compiled: Any, rep: Report, *, training: bool) -> None:
    """Start, mark and stop profiles at a call of a compiled object (a step when ``training``)."""
    if not training:
        return
    auto = _auto_profile()
    if auto is not None:
        auto.on_step(compiled, rep)
    running = _running
    if running is not None and running.compiled is compiled:
        running._mark_step()


def stop_at_exit() -> None:
    """Close a profile ``$BUCKETWISE_PROFILE_STEPS`` started that the job did not run to its end."""
    if _auto is not None and _auto.session is not None:
        try:
            _auto.finish(at_exit=True)
        except Exception as exc:  # noqa: BLE001 - at exit: say it, do not mask the job's own outcome
            log.warning("bucketwise: the runtime profile could not be written at exit: %s: %s", type(exc).__name__, exc)
