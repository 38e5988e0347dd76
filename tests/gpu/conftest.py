"""The GPU suite's order: its longest tests first, so that with ``-n 2`` the short ones fill the
end of both workers' time instead of a long one running alone last (the suite must fit a
10-minute device call)."""

from __future__ import annotations

LONGEST_FIRST = (
    "test_gpu_zoo_grads.py",
    "test_gpu_comm_hooks.py",
    "test_gpu_no_sync.py",
    "test_gpu_sharing_by_cost.py",
)


def pytest_collection_modifyitems(session, config, items) -> None:
    def rank(item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)


def pytest_runtest_logreport(report) -> None:
    # A run stopped by the device call's time limit still names what failed (``-q`` prints an F).
    if report.failed:
        print(f"\nFAILED {report.nodeid} ({report.when}, {report.duration:.0f} s)", flush=True)
