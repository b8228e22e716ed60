"""The round executor: one function, replayed per batch bucket or run eagerly at the exact
batch, and queued behind a replayed round with its outputs copied out of the graph."""

from __future__ import annotations

import torch

from polyspec.plugins import create_backend
from polyspec.runtime.executor import RoundExecutor
from polyspec.runtime.graphs import CapturedForwards, GraphBuckets


def _executor():
    backend = create_backend("cpu")
    graphs = CapturedForwards(backend, GraphBuckets(batch_sizes=(1, 2, 4), prefix_lens=(16,)))
    calls = []

    def fn(inputs, b, max_prefix, host):
        calls.append((b, max_prefix, host))
        x = inputs["x"]  # [b, 2]
        return x.sum(1), x * 2

    return RoundExecutor(backend, graphs), fn, calls


def test_a_batch_in_a_bucket_replays_and_a_larger_one_runs_eagerly_at_its_size():
    executor, fn, calls = _executor()
    x = torch.arange(6).view(3, 2)
    got = executor.launch((7, 8, 9), "f", fn, {"x": x}, 10, "lengths")
    assert got.captured and got.rows == 4 and calls[-1] == (4, 16, None)  # padded, no host
    assert got.result()[:3].tolist() == [1, 5, 9]
    big = torch.arange(10).view(5, 2)
    got = executor.launch((1, 2, 3, 4, 5), "f", fn, {"x": big}, 10, "lengths")
    assert not got.captured and got.rows == 5 and calls[-1] == (5, None, "lengths")
    assert got.result().tolist() == [1, 5, 9, 13, 17]
    assert executor.queue_next(got, {"x": big}, 10) is None  # an eager round is not queued
    assert executor.launch((1,), "f", fn, {"x": x[:1]}, 40, None).captured is False  # prefix


def test_a_queued_round_keeps_the_round_before_it_readable():
    executor, fn, _ = _executor()
    x = torch.arange(4).view(2, 2)
    first = executor.launch((1, 2), "f", fn, {"x": x}, 10, None, copy=True)
    queued = executor.queue_next(first, {"x": x + 1}, 10)
    assert queued is not None and queued.key == (1, 2) and queued.read is not None
    assert first.result()[:2].tolist() == [1, 5]  # a copy: the replay after it did not touch it
    assert queued.result()[:2].tolist() == [3, 7]
    assert first.outputs[1][:2].tolist() == [[0, 2], [4, 6]]
