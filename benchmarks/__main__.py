"""One front door to the benchmarks: ``python -m bucketwise.benchmarks COMMAND [ARGS...]``.

Each command is one harness; ``COMMAND --help`` shows its arguments, benchmarks/README.md what
it measures. ``probe NAME [ARGS...]`` runs a module of ``bucketwise.benchmarks.probes``: a
one-question measurement behind a decision in the code or the docs.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import sys
from typing import Any


@dataclasses.dataclass(frozen=True)
class Command:
    module: str
    """Module of ``bucketwise.benchmarks`` whose ``main(argv)`` runs it."""
    summary: str


COMMANDS: dict[str, Command] = {
    "ddp": Command("ddp.bench", "DDP training steps: eager DDP, torch.compile and bucketwise side by side, N ranks"),
    "tax": Command("tax.bench", "what DDP and bucketwise add to a compiled step, configs interleaved in one process"),
    "memory": Command("ddp.memory", "memory at rest, at the peak and after the model is dropped, one process each"),
    "zoo": Command(
        "zoo.main", "real models (HF, timm, torchvision) under eager DDP and bucketwise: equal, and how fast"
    ),
    "zoo-table": Command("tables.zoo", "the zoo's docs tables from its results"),
    "hf-trainer": Command("apps.hf_trainer", "the HF Trainer with and without bucketwise"),
    "numerics": Command("ddp.numerics", "losses of bucketwise variants against eager DDP over many steps"),
    "tables": Command("tables.perf", "the performance tables of README.md and docs/performance.md from results/"),
    "sweep-table": Command("tables.sweep", "one table and plot from several ddp runs (a bucket_cap_mb sweep)"),
    "plots": Command("tables.plots", "re-draw the plots of a finished ddp run"),
}


def probes() -> list[str]:
    from . import probes as package

    return sorted(m.name for m in pkgutil.iter_modules(package.__path__) if not m.name.startswith("_"))


def usage() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = ["usage: python -m bucketwise.benchmarks COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {c.summary}" for name, c in COMMANDS.items()]
    lines += [f"  {'probe':<{width}}  NAME [ARGS...]: one of {', '.join(probes())}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> Any:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name == "probe":
        known = probes()
        if not rest or rest[0] not in known:
            got = repr(rest[0]) if rest else "nothing"
            print(f"probe: expected one of {known}, got {got}", file=sys.stderr)
            return 2
        sys.argv[0] = f"python -m bucketwise.benchmarks probe {rest[0]}"
        return importlib.import_module(f"bucketwise.benchmarks.probes.{rest[0]}").main(rest[1:])
    command = COMMANDS.get(name)
    if command is None:
        print(f"unknown command {name!r}; expected one of {[*COMMANDS, 'probe']}\n\n{usage()}", file=sys.stderr)
        return 2
    # What each harness's --help and errors call it (its metadata records sys.orig_argv, the
    # command as typed).
    sys.argv[0] = f"python -m bucketwise.benchmarks {name}"
    return importlib.import_module(f"bucketwise.benchmarks.{command.module}").main(rest)


if __name__ == "__main__":
    sys.exit(main())
