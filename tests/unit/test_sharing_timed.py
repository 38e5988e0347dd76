"""The rule ``share_blocks="auto"`` applies without CUDA graphs on a GPU, from the compiled block's
timed call on every rank (NOTE [sharing measured at compile time]). The timing itself runs on a GPU:
tests/gpu/test_gpu_sharing_timed.py; here the rule, and the agreement of two real ranks."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from support.dist import run_distributed

from bucketwise.compiler.block_timing import HOST_SHARE_LIMIT, BlockTiming, TimedSharing, verdict
from bucketwise.distributed.rank_check import prepare_rank_checks
from bucketwise.stats.report import Report


def _timing(host_ms: float, gpu_ms: float, held: bool = True) -> BlockTiming:
    return BlockTiming(host_ms=host_ms, gpu_ms=gpu_ms, held=held)


def test_blocks_share_where_the_host_issues_a_call_in_a_fraction_of_its_gpu_time():
    at_limit = _timing(HOST_SHARE_LIMIT * 2.0, 2.0)
    assert verdict([[_timing(0.5, 4.0)]]) is None
    assert verdict([[at_limit]]) is None


def test_blocks_whose_call_would_keep_the_gpu_waiting_stay_whole_with_the_figures():
    why = verdict([[_timing(1.7, 1.3)]])
    assert why is not None
    assert "the host took 1.700 ms to issue one and the GPU 1.300 ms to run it (1.31x" in why, why
    assert "share_blocks=True" in why and "cudagraphs=True" in why, why


def test_a_host_that_outran_the_hold_counts_as_bound_by_the_host():
    """``held=False``: the GPU figure includes waits for the host, whatever it says."""
    why = verdict([[_timing(0.1, 4.0, held=False)]])
    assert why is not None and "longer than the GPU waited for it" in why, why


def test_a_block_that_could_not_be_timed_stays_whole():
    why = verdict([[None]])
    assert why is not None and "could not be timed" in why and "share_blocks=True" in why, why


def test_the_worst_rank_and_block_decide_for_all():
    fast, slow = _timing(0.5, 4.0), _timing(3.0, 4.0)
    assert verdict([[fast, fast], [fast, fast]]) is None
    why = verdict([[fast, fast], [fast, slow]])
    assert why is not None and "on rank 1" in why and "0.75x" in why, why


def _ranks_time_differently(rank: int, world: int) -> dict:
    prepare_rank_checks(dist.group.WORLD)
    report = Report(target="DDP(Net)", strategy="auto", backend="inductor")
    # Rank 1's host is slower: both ranks must come to the same answer, or their graphs (and
    # collectives) would differ.
    mine = [_timing(0.5, 4.0)] if rank == 0 else [_timing(3.5, 4.0)]
    why = TimedSharing(report=report, group=dist.group.WORLD).refusal("layers", 4, mine, spent_s=2.5)
    return {"why": why, "unshared": report.to_dict()["unshared_blocks"]}


def test_ranks_that_time_a_block_differently_decide_alike(tmp_path):
    r0, r1 = run_distributed(_ranks_time_differently, tmp_path, timeout=60)
    assert r0["why"] == r1["why"] and "on rank 1" in r0["why"], (r0, r1)
    for r in (r0, r1):
        (entry,) = r["unshared"]
        assert (entry["container"], entry["blocks"], entry["host_time"]) == ("layers", 4, True), entry


@pytest.mark.parametrize("group", [None, "world of one"])
def test_one_process_decides_from_its_own_timing(single_rank_group, group):
    report = Report(target="Net", strategy="auto", backend="inductor")
    pg = dist.group.WORLD if group else None
    assert TimedSharing(report=report, group=pg).refusal("layers", 4, [_timing(0.5, 4.0)], spent_s=2.5) is None
    assert report.to_dict()["unshared_blocks"] == []
    why = TimedSharing(report=report, group=pg).refusal("layers", 4, [_timing(5.0, 4.0)], spent_s=2.5)
    assert why is not None and "on rank" not in why, why
    # What the blocks' compile cost this graph, which it did not keep, is said too.
    assert why.endswith("(compiling and timing the block took 2.5 s of this graph's compile)"), why
    assert report.to_dict()["unshared_blocks"][0]["reason"] == why
