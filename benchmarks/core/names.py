"""The benchmarks' one config vocabulary: what a config name says, and which configs each harness runs.

A name is ``<compiler>[-<variant>...]``: ``eager`` (eager DDP), ``torch`` (``torch.compile(DDP(model))``),
``local`` (``torch.compile(model)``, no DDP), ``regional``, ``replicate``, ``bw-<strategy>``
(``bucketwise.compile(DDP(model), strategy=...)``); suffixes ``-ro`` (``mode="reduce-overhead"``),
``-cg`` (``cudagraphs=True``), ``-blocks`` (``share_blocks=True``), ``-whole``
(``share_blocks=False``), ``-cpp`` (Inductor's C++ wrapper), ``-nomix``
(Inductor's mix-order reduction off), a comm hook (``-bf16``, ``-powersgd``)
and so on. ``core/configs.py`` holds the recipe behind each name; this module holds only names,
so that the table generators read results without importing torch.

Results written before the vocabulary was one used other names for some of these configs (the
zoo's check runs: ``auto``, ``fused``, ``split``; the HF Trainer runs: ``fused``, ``split``,
``torch_compile``); readers map them with :func:`canonical`.
"""

from __future__ import annotations

from typing import Iterable

LEGACY_NAMES = {
    "auto": "bw-auto",
    "fused": "bw-fused",
    "split": "bw-split",
    "none": "bw-none",
    "torch_compile": "torch",
}
"""Older results' names -> the vocabulary's."""

ZOO_CHECK = ("torch", "bw-auto", "bw-fused", "bw-split")
"""The zoo's correctness run (eager DDP is the reference, always run)."""
ZOO_CHECK_ON_REQUEST = ("bw-auto-blocks",)
"""Checked against eager DDP when ``--configs`` names it: ``auto`` with ``share_blocks=True``."""
ZOO_SPEED = ("local", "torch", "bw-fused", "bw-fused-cg")
"""The zoo's one-GPU speed run (eager DDP is the reference, always run)."""
HF_TRAINER = ("bw-fused", "bw-split", "torch", "eager")
"""The HF Trainer harness: ``bw-fused`` is ``BucketwiseTrainer``, ``bw-split`` the Dynamo backend
``torch.compile(model, backend="bucketwise")`` (``split`` under DDP), ``torch`` the Trainer's own
``torch_compile=True``, ``eager`` no compile."""


def canonical(name: str) -> str:
    """A config name in the vocabulary (an older result's name mapped, ``#N`` repeats kept)."""
    base, sep, rest = name.partition("#")
    return LEGACY_NAMES.get(base, base) + sep + rest


def strategy_of(name: str) -> str | None:
    """The bucketwise strategy a ``bw-`` config names (``bw-fused-cg`` -> ``fused``), else ``None``."""
    if not name.startswith("bw-"):
        return None
    return name.removeprefix("bw-").split("-", 1)[0]


def check_names(names: Iterable[str], known: Iterable[str], *, flag: str = "--configs") -> list[str]:
    """``names`` as a list, or ``ValueError`` naming each unknown one, its new name where an older
    result used it, and the known ones."""
    names, known = list(names), list(known)
    bad = [n for n in names if n not in known]
    if not bad:
        return names
    hints = [f"{n!r} (now {canonical(n)!r})" if canonical(n) in known else repr(n) for n in bad]
    raise ValueError(f"{flag}: unknown {', '.join(hints)}; known: {', '.join(known)}")
