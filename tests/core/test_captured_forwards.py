"""CapturedForwards' bookkeeping: buckets, declared computations and capture_all's limits."""

from __future__ import annotations

import torch

from polyspec.plugins import create_backend
from polyspec.runtime.graphs import CapturedForwards, GraphBuckets


def _double(s, bs: int, max_prefix: int):  # noqa: ARG001
    return s["x"] * 2


def test_buckets_default():
    b = GraphBuckets.default(max_batch_size=20, max_graph_batch_size=32, table_width=1000)
    assert b.batch_sizes == (1, 2, 4, 8, 16, 20)
    assert b.prefix_lens == (256, 512, 1000)
    assert b.batch_bucket(3) == 4 and b.batch_bucket(21) is None
    assert b.prefix_bucket(0) == 256 and b.prefix_bucket(1001) is None


def test_declared_computations_are_captured_within_their_batch_limit():
    graphs = CapturedForwards(create_backend("cpu"), GraphBuckets((1, 2, 4), (256, 512)))
    template = {"x": (8, (), torch.float32, torch.device("cpu"))}
    graphs.declare("wide", _double, template, max_batch=2)
    graphs.declare("narrow", _double, {"x": (1, (), torch.float32, torch.device("cpu"))})
    assert graphs.capture_all(max_batch_size=4, max_prefix=300) == 2 * 2 + 3 * 2
    assert {(n, b) for n, b, _ in graphs.captured if n == "wide"} == {("wide", 1), ("wide", 2)}
    # a declared computation replays like one seen in a run; shorter inputs are zero-padded
    out = graphs.run("wide", 2, 10, {"x": torch.ones(16)}, _double)
    assert out.shape == (16,) and torch.equal(out, torch.full((16,), 2.0))
    out = graphs.run("narrow", 3, 10, {"x": torch.ones(3)}, _double)
    assert out.tolist() == [2.0, 2.0, 2.0, 0.0]
    assert graphs.capture_all(max_batch_size=4, max_prefix=300) == 0  # nothing new


def test_prefill_width_buckets_and_limits():
    """A prefill chunk is padded to the smallest width that holds the longest; steps whose
    padded tokens pass the cap, chunks over the widest width, and engines without graphs or
    with a bounded graph budget run eagerly."""
    from polyspec import LLM
    from polyspec.testing.builders import build_bigram_models

    backend = create_backend("cpu")
    target, _ = build_bigram_models(backend)
    llm = LLM.from_modules(
        target, backend=backend, max_batch_size=8, max_context=1024, graphs="on",
        max_tokens_per_step=512,
    )  # fmt: skip
    worker = llm.worker
    assert worker.graph_prefill_tokens == 1024  # twice the step budget
    assert worker._prefill_width(1, 5, 0) == 16
    assert worker._prefill_width(3, 17, 0) == 32
    assert worker._prefill_width(1, 512, 0) == 512
    assert worker._prefill_width(1, 513, 0) is None  # wider than any width
    assert worker._prefill_width(2, 512, 0) == 512
    assert worker._prefill_width(3, 300, 0) is None  # bucket 4 x 512 > 1024
    assert worker._prefill_width(8, 128, 0) == 128
    assert worker._prefill_width(1, 20, 5000) is None  # past every prefix bucket
    eager = LLM.from_modules(target, backend=backend, max_batch_size=8, graphs="off")
    assert eager.worker.graphs is None
