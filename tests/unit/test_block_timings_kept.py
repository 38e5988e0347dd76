"""A compiled block's timing kept for the next compile of the same block (NOTE [block timings
kept]): the FX-graph cache key it is kept under, the file, and what the report says of a kept
timing. Timing itself and its reuse across compiles run on a GPU:
tests/gpu/test_gpu_sharing_timed.py."""

from __future__ import annotations

import logging

import torch

from bucketwise._compat import aot
from bucketwise.compiler.block_timing import BlockTiming, keep, kept_path, read_kept, verdict


def _mm_relu(x, w):
    return (torch.relu(x @ w) + 1.0,)


def _mm_tanh(x, w):
    return (torch.tanh(x @ w) + 1.0,)


def test_a_compiled_graph_is_keyed_alike_at_every_compile_and_apart_from_another():
    args = (torch.randn(4, 4), torch.randn(4, 4))
    first = aot.graph_cache_key(aot.inductor_compile_function(_mm_relu, args))
    again = aot.graph_cache_key(aot.inductor_compile_function(_mm_relu, args))
    other = aot.graph_cache_key(aot.inductor_compile_function(_mm_tanh, args))
    assert isinstance(first, str) and first, first
    assert first == again and other != first, (first, again, other)


def test_a_kept_timing_reads_back_with_where_it_was_kept(tmp_path):
    path = tmp_path / "block_timings" / "b.json"
    keep(path, BlockTiming(host_ms=1.25, gpu_ms=2.5, held=True))
    kept = read_kept(path)
    assert kept == BlockTiming(host_ms=1.25, gpu_ms=2.5, held=True, kept=str(path)), kept
    assert kept.to_dict() == {"host_ms": 1.25, "gpu_ms": 2.5, "held": True, "kept": str(path)}
    # What was timed now says nothing of a file.
    assert "kept" not in BlockTiming(host_ms=1.25, gpu_ms=2.5, held=True).to_dict()
    assert [p.name for p in path.parent.iterdir()] == ["b.json"]  # no partial file left


def test_no_kept_timing_or_an_unreadable_one_times_the_block_again(tmp_path, caplog):
    assert read_kept(tmp_path / "none.json") is None
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="bucketwise.compiler.block_timing"):
        assert read_kept(bad) is None
    assert "could not be read" in caplog.text and str(bad) in caplog.text, caplog.text


def test_a_block_off_the_gpu_keeps_no_timing():
    compiled = aot.inductor_compile_function(_mm_relu, (torch.randn(4, 4), torch.randn(4, 4)))
    assert kept_path(compiled, compiled, [torch.randn(4, 4)]) is None


def test_a_decision_from_a_kept_timing_says_which_file_to_delete_to_time_again(tmp_path):
    kept = BlockTiming(host_ms=1.7, gpu_ms=1.3, held=True, kept=str(tmp_path / "t.json"))
    why = verdict([[kept]])
    assert why is not None and f"delete {tmp_path / 't.json'} to time it again" in why, why


def test_kept_timings_travel_with_the_compile_artifacts(tmp_path, monkeypatch):
    """NOTE [compile artifacts]: a new machine (an empty cache folder) that loads the artifacts
    finds the timings the saving run kept, so it decides as that run did."""
    from bucketwise.compiler.artifacts import Artifacts
    from bucketwise.compiler.block_timing import kept_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "machine-a"))
    aot.inductor_compile_function(_mm_relu, (torch.randn(4, 4), torch.randn(4, 4)))  # something to save
    keep(kept_dir() / "block.json", BlockTiming(host_ms=1.25, gpu_ms=2.5, held=True))
    artifacts = tmp_path / "artifacts" / "rank0.bin"
    saved = Artifacts(path=artifacts).save()
    assert ", 1 block timing" in saved and (artifacts.parent / "block_timings" / "block.json").is_file(), saved

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "machine-b"))
    assert read_kept(kept_dir() / "block.json") is None
    loaded = Artifacts(path=artifacts).load()
    assert ", 1 block timing" in loaded, loaded
    kept = read_kept(kept_dir() / "block.json")
    assert kept is not None and (kept.host_ms, kept.gpu_ms, kept.held) == (1.25, 2.5, True), kept
    assert kept.kept.startswith(str(tmp_path / "machine-b")), kept


def test_timings_that_cannot_be_copied_are_said_not_raised(tmp_path, monkeypatch):
    from bucketwise.compiler.artifacts import Artifacts
    from bucketwise.compiler.block_timing import kept_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "machine-a"))
    aot.inductor_compile_function(_mm_relu, (torch.randn(4, 4), torch.randn(4, 4)))
    keep(kept_dir() / "block.json", BlockTiming(host_ms=1.25, gpu_ms=2.5, held=True))
    (tmp_path / "artifacts").mkdir()
    (tmp_path / "artifacts" / "block_timings").write_text("a file where the folder would go")
    saved = Artifacts(path=tmp_path / "artifacts" / "rank0.bin").save()
    assert ", block timings not copied to" in saved and (tmp_path / "artifacts" / "rank0.bin").is_file(), saved
