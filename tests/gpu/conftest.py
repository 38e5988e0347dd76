"""The GPU suite's order: its longest test first, so that with ``-n 2`` the other worker runs the
rest beside it instead of after it (the suite must fit a 10-minute device call)."""

from __future__ import annotations

LONGEST_FIRST = ("test_gpu_zoo_grads.py",)


def pytest_collection_modifyitems(session, config, items) -> None:
    items.sort(key=lambda item: item.path.name not in LONGEST_FIRST)


def pytest_runtest_logreport(report) -> None:
    # A run stopped by the device call's time limit still names what failed (``-q`` prints an F).
    if report.failed:
        print(f"\nFAILED {report.nodeid} ({report.when}, {report.duration:.0f} s)", flush=True)
