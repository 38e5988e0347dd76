"""How well compiled segments coincide with the buckets DDP's reducer really uses."""

from __future__ import annotations

from typing import Any, Mapping

from ..._compat import ddp as ddpc


def measure_alignment(
    ddp: Any, param_segments: Mapping[int, Mapping[str, int]], *, eager_code: bool = True
) -> dict[str, Any]:
    """``alignment`` = fraction of the reducer's buckets whose parameters all lie in one compiled
    segment; a parameter several frames read belongs to the earliest (its backward completes it).

    A parameter no graph reads is ``eager`` where ``eager_code`` (a bucket then waits for code
    outside the graphs), else unused (DDP marks it ready after the forward); buckets of such
    parameters only are left out. ``None`` ("pending") until the reducer has rebuilt its buckets.
    """
    buckets, source = ddpc.reducer_buckets(ddp)
    if buckets is None:
        return {
            "alignment": None,
            "status": "pending: DDP's reducer rebuilds its buckets after the first iterations",
        }
    names = [name for name, _ in ddpc.reducer_parameters(ddp)]
    where: dict[str, tuple[int, int]] = {}
    for frame in sorted(param_segments):
        for name, seg in param_segments[frame].items():
            where.setdefault(name, (frame, seg))
    rows = []
    aligned = considered = 0
    for index, members in enumerate(buckets):
        member_names = [names[i] if i < len(names) else f"#{i}" for i in members]
        unread = [n for n in member_names if n not in where]
        places = sorted({where[n] for n in member_names if n in where})
        if not places:
            status = "eager" if eager_code else "not read by any graph"
        else:
            if eager_code and unread:
                places = [(-1, -1), *places]
            considered += 1
            aligned += len(places) == 1
            if len(places) > 1:
                status = "split across " + ", ".join("eager" if g < 0 else f"frame {g} segment {s}" for g, s in places)
            else:
                status = "aligned" + (f"; not read by any graph: {_names(unread)}" if unread else "")
        rows.append({"bucket": index, "params": member_names, "status": status})
    return {
        "alignment": aligned / considered if considered else None,
        "status": f"reducer buckets: {source}",
        "buckets": rows,
    }


def _names(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


class AlignmentPoll:
    """Rewrites the rank file once DDP's rebuilt buckets make the alignment known: DDP refreshes
    the logging data they are read from on its first iterations, so at most ``POLLS`` forwards ask."""

    POLLS = 20

    def __init__(self, report: Any, ddp: Any) -> None:
        self.report, self.ddp = report, ddp
        self.polls = 0

    def after_forward(self) -> None:
        if self.polls >= self.POLLS or not self.report.graphs:
            return
        if ddpc.will_rebuild(self.ddp) and not ddpc.has_rebuilt_buckets(self.ddp):
            return
        self.polls += 1
        if self.report.alignment is not None or self.polls >= self.POLLS:
            self.polls = self.POLLS
            self.report.write_rank_file()
