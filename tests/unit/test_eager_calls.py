"""Never run eagerly without saying so (NOTE [never silently eager] in compiler/module.py).

A compiled object either runs its compiled graphs or says, in its report, table, per-rank stats
(so ``bucketwise launch`` / ``stats`` / ``doctor``) and a warning, that a call ran eagerly and
why. And compiled objects do not compete for Dynamo's recompile limit (NOTE [one cache per
compiled object]).
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import bucketwise
from bucketwise.launch import stats


class Net(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.a = nn.Linear(8, width)
        self.b = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def test_many_models_of_one_class_each_get_compiled(single_rank_group):
    # A sweep: 11 models of one class, each with its own width. They used to share one Dynamo
    # cache entry list (limit 8): from the 9th on they ran eagerly.
    for i in range(11):
        torch.manual_seed(i)
        model = Net(16 + i)
        compiled = bucketwise.compile(DDP(model), backend="aot_eager")
        x = torch.randn(4, 8)
        compiled(x).sum().backward()
        rep = bucketwise.report(compiled).to_dict()
        assert rep["totals"]["graphs"] == 1 and rep["totals"]["eager_calls"] == 0, (
            i,
            rep["totals"],
            rep["eager_calls"],
        )
        assert rep["graphs"][0]["strategy"] == "fused", (i, rep["graphs"][0]["strategy_reason"])


def test_a_call_past_the_recompile_limit_is_reported(caplog, tmp_path, monkeypatch):
    monkeypatch.setenv("BUCKETWISE_STATS_DIR", str(tmp_path))
    compiled = bucketwise.compile(Net(), backend="aot_eager", dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=2), caplog.at_level(logging.WARNING, logger="bucketwise"):
        outs = [compiled(torch.randn(b, 8)) for b in (2, 3, 4, 5)]  # 2 compiles, then eager twice
    assert [o.shape[0] for o in outs] == [2, 3, 4, 5]
    rep = bucketwise.report(compiled)
    data = rep.to_dict()
    assert data["totals"]["graphs"] == 2 and data["totals"]["eager_calls"] == 2, data["totals"]
    ((reason, count),) = data["eager_calls"].items()
    assert count == 2 and "recompile limit (2" in reason, reason
    assert f"ran eagerly: 2 call(s): {reason}" in rep.table()
    warned = [r for r in caplog.records if "ran eagerly" in r.getMessage()]
    assert len(warned) == 1 and "Net" in warned[0].getMessage(), [r.getMessage() for r in caplog.records]
    # What `bucketwise launch`, `stats` and `doctor` print from the rank files.
    lines = stats.eager_summary(str(tmp_path))
    assert lines == [f"Net RAN EAGERLY on rank 0 (2 call(s)): {reason}"], lines
    assert lines[0] in stats.format_merged(stats.merge(stats.load_reports(str(tmp_path), print)))


def test_a_compiled_function_that_runs_eagerly_says_so():
    def f(x):
        return torch.sin(x) * 2

    compiled = bucketwise.compile(f, backend="aot_eager", dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=1):
        compiled(torch.randn(2))
        compiled(torch.randn(3))
    assert bucketwise.report(compiled).to_dict()["totals"]["eager_calls"] == 1


def test_frozen_eager_recompiles_are_counted():
    compiled = bucketwise.compile(Net(), backend="aot_eager", dynamic=False, freeze="eager")
    compiled(torch.randn(2, 8))
    compiled(torch.randn(3, 8))  # a new shape after freezing: runs eagerly, by request
    (reason,) = bucketwise.report(compiled).to_dict()["eager_calls"]
    assert "frozen" in reason, reason


class Disabled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.tail = Tail()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(self.a(x))


class Tail(nn.Module):
    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def test_disabled_regions_are_listed():
    compiled = bucketwise.compile(Disabled(), backend="aot_eager")
    compiled(torch.randn(2, 8))
    data = bucketwise.report(compiled).to_dict()
    assert data["totals"]["eager_calls"] == 0  # graphs ran; the disabled region is by design
    assert len(data["eager_regions"]) == 1 and "torch.compiler.disable" in data["eager_regions"][0], data[
        "eager_regions"
    ]
    assert "runs eagerly between graphs: " in bucketwise.report(compiled).table()
