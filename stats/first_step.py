"""Where a compiled object's first step goes: compiling, Triton autotuning, other first-call work.

NOTE [first step]: a first step takes longer than what torch records as compiling (NOTE
[compile-time breakdown]): Triton autotuning, kernel and CUDA library loading, NCCL setup, the
first backward. So the compiled object's first call and its backward are timed (wall clock, no
device sync) and torch's autotuning timer read across them; ``first_step`` in the report's totals
splits the compiled calls' wall time into compile, autotuning and the rest. Nothing is timed
after the first call.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

from .._compat import autograd as agc
from .._compat import dynamo as dc

_AUTOTUNE_PHASES = ("CachingAutotuner.benchmark_all_configs", "CachingAutotuner.coordinate_descent_tuning")


def _autotune_seconds() -> float:
    phases = dc.compile_phase_seconds()
    return sum(phases.get(name, 0.0) for name in _AUTOTUNE_PHASES)


@dataclasses.dataclass
class FirstStep:
    """The first call of a compiled object and its backward (NOTE [first step])."""

    forward_s: float | None = None
    """Wall seconds of the first call (compiles of the graphs it meets included)."""
    backward_s: float | None = None
    """Wall seconds of the backward that call's outputs started (``None``: none ran yet)."""
    autotune_s: float = 0.0
    """Triton autotuning within both, by torch's timer."""
    start_us: int | None = None
    end_us: int | None = None
    device: str | None = None
    """Where the first call's outputs are: ``cuda``, ``cpu``, ... (what the first-call work is)."""
    _autotune_at_start: float = 0.0
    _t0: float = 0.0
    _hooks: list[Any] = dataclasses.field(default_factory=list)
    _backward_seen: bool = False

    @property
    def pending(self) -> bool:
        """The first call has not happened yet."""
        return self.start_us is None

    def start(self) -> None:
        self.start_us = dc.wall_us()
        self._autotune_at_start = _autotune_seconds()
        self._t0 = time.perf_counter()

    def forward_done(self, output: Any) -> None:
        """After the first call: time it, and time the backward its outputs start."""
        self.forward_s = time.perf_counter() - self._t0
        self.end_us = dc.wall_us()
        self.autotune_s = _autotune_seconds() - self._autotune_at_start
        tensors = agc.tensor_leaves(output)
        self.device = next((t.device.type for t in tensors if t.device.type != "cpu"), "cpu" if tensors else None)
        nodes = {t.grad_fn for t in tensors if t.grad_fn is not None}
        self._hooks = [node.register_prehook(self._backward_started) for node in nodes]

    def _backward_started(self, grad_outputs: Any) -> None:
        if self._backward_seen:
            return None  # another output's node of the same backward, or a later one
        self._backward_seen = True
        t0 = time.perf_counter()

        def backward_done() -> None:
            self.backward_s = time.perf_counter() - t0
            self.end_us = dc.wall_us()
            self.autotune_s = _autotune_seconds() - self._autotune_at_start
            # Removed here, not in the hook: the engine is iterating over them there.
            for handle in self._hooks:
                handle.remove()
            self._hooks = []

        agc.queue_backward_callback(backward_done)
        return None

    def summary(self, compiled_within: Callable[[int, int], float]) -> dict[str, Any] | None:
        """``compiled_within(start_us, end_us)``: compile seconds of the graphs compiled then."""
        if self.forward_s is None or self.start_us is None or self.end_us is None:
            return None
        wall = self.forward_s + (self.backward_s or 0.0)
        compile_s = compiled_within(self.start_us, self.end_us)
        return {
            "compiled_calls_s": round(wall, 6),
            "forward_s": round(self.forward_s, 6),
            "backward_s": None if self.backward_s is None else round(self.backward_s, 6),
            "compile_s": round(compile_s, 6),
            "autotune_s": round(self.autotune_s, 6),
            "other_s": round(max(0.0, wall - compile_s - self.autotune_s), 6),
            "device": self.device,
        }


_OTHER_WORK = {
    "cuda": "kernel and CUDA library loading, NCCL set-up",
    "cpu": "on CPU: loading the compiled code, the process group's first collective",
}
_OTHER_WORK_UNKNOWN = "loading the compiled code and its libraries, the process group's first collective"


def describe(summary: dict[str, Any] | None) -> str | None:
    """One line for the report's table."""
    if not summary:
        return None
    bwd = "" if summary["backward_s"] is not None else " (no backward yet)"
    other = _OTHER_WORK.get(summary.get("device") or "", _OTHER_WORK_UNKNOWN)
    return (
        f"first step: compiled calls {summary['compiled_calls_s']:.2f} s{bwd} = compile {summary['compile_s']:.2f} s"
        f" + Triton autotuning {summary['autotune_s']:.2f} s + other first-call work {summary['other_s']:.2f} s "
        f"({other}); the rest of the step is eager code around the compiled calls"
    )
