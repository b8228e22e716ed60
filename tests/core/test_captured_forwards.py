"""CapturedForwards' bookkeeping: buckets, declared computations and capture_all's limits."""

from __future__ import annotations

import pytest
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


def test_buckets_cover_max_batch_size_unless_capped():
    """By default the top bucket is max_batch_size (steps of 8 to 64, 16 to 256, then 32);
    an explicit max_graph_batch_size caps it, and larger batches run eagerly."""
    from polyspec import LLM
    from polyspec.testing.builders import build_bigram_models

    b = GraphBuckets.default(max_batch_size=300, max_graph_batch_size=None, table_width=512)
    assert b.batch_sizes == (1, 2, 4, *range(8, 64, 8), *range(64, 256, 16), 256, 288, 300)
    assert b.batch_bucket(65) == 80 and b.batch_bucket(300) == 300
    assert GraphBuckets.default(300, 32, 512).batch_sizes[-1] == 32
    assert GraphBuckets.default(300, 1000, 512).batch_sizes[-1] == 300
    backend = create_backend("cpu")
    target, _ = build_bigram_models(backend)
    kw = {"backend": backend, "max_batch_size": 40, "max_context": 128, "graphs": "on"}
    auto = LLM.from_modules(target, **kw)
    assert auto.worker.graphs.buckets.batch_sizes == (1, 2, 4, 8, 16, 24, 32, 40)
    assert auto.worker.executor.captures(40, 100)
    capped = LLM.from_modules(target, max_graph_batch_size=16, **kw)
    assert capped.worker.graphs.buckets.batch_sizes[-1] == 16
    assert capped.worker.executor.captures(16, 100) and not capped.worker.executor.captures(17, 100)


MIB = 2**20


def _tight_memory_backend(free_mib: int, total_mib: int = 1000, mib_per_row: int = 4):
    """A cpu backend that declares real graph capture and reports a device of ``total_mib``
    with ``free_mib`` free, each capture taking ``mib_per_row`` per row of its batch bucket."""
    import dataclasses

    backend = create_backend("cpu")
    backend.capabilities = dataclasses.replace(backend.capabilities, graph_capture=True)
    device = {"free": free_mib * MIB}
    backend.memory_info = lambda: (device["free"], total_mib * MIB)
    make_runner = backend.make_graph_runner

    def runner_taking_memory():
        runner = make_runner()
        capture = runner.capture

        def capture_taking_memory(key, fn, static_inputs):
            device["free"] -= mib_per_row * key[1] * MIB  # key: (name, batch bucket, prefix)
            return capture(key, fn, static_inputs)

        runner.capture = capture_taking_memory
        return runner

    backend.make_graph_runner = runner_taking_memory
    return backend, device


def test_capture_stops_at_the_memory_margin_and_runs_eagerly(caplog):
    """Captures that would leave less than MEMORY_MARGIN of the device free are not made:
    those buckets run eagerly, said once, and the tokens are the eager engine's."""
    from polyspec import LLM, SamplingParams
    from polyspec.runtime import graphs as graphs_module
    from polyspec.testing.builders import build_bigram_models

    backend, device = _tight_memory_backend(free_mib=150)
    target, _ = build_bigram_models(backend)
    prompts = [[5 + i, 9, 3 + 2 * i][: 1 + i % 3] for i in range(8)]
    params = [SamplingParams(max_new_tokens=6 + 3 * i, ignore_eos=True) for i in range(8)]
    kw = {"backend": backend, "max_batch_size": 8, "max_context": 128}
    with caplog.at_level("WARNING", logger="polyspec.engine"):
        llm = LLM.from_modules(target, graphs="auto", **kw)
        got = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    graphs = llm.worker.graphs
    margin = graphs_module.MEMORY_MARGIN * 1000 * MIB
    assert graphs.num_captured > 0 and graphs.eager_from is not None
    assert device["free"] >= margin  # no capture went below the margin
    report = graphs.memory_report()
    assert report["bytes"] == 150 * MIB - device["free"] > 0
    assert report["free_before"] == 150 * MIB and report["free_after"] == device["free"]
    stops = [r for r in caplog.records if "graph capture stopped" in r.getMessage()]
    assert len(stops) == 1
    # capture_all leaves the same buckets out and reports each attempt
    calls = []
    graphs.capture_all(8, 100, progress=lambda done, total: calls.append((done, total)))
    assert calls and calls[-1][0] == calls[-1][1] and device["free"] >= margin
    eager = LLM.from_modules(target, graphs="off", **kw)
    want = eager.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    # with room to spare every bucket is captured and nothing is left eager
    roomy, _ = _tight_memory_backend(free_mib=900)
    llm = LLM.from_modules(target, graphs="auto", **{**kw, "backend": roomy})
    llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert llm.worker.graphs.eager_from is None and llm.worker.graphs.memory_report()["bytes"] > 0


def test_a_prefill_too_wide_for_one_graph_replays_a_few_and_changes_nothing():
    """One long prompt among short ones: padded to the long one's width the batch passes the
    cap, so the prefill replays two graphs (short ones, then the long one) instead of running
    eagerly; the greedy outputs, speculative and plain, equal the eager engines'."""
    from polyspec import LLM, SamplingParams, SpeculativeConfig
    from polyspec.testing.builders import build_bigram_models

    backend = create_backend("cpu")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 60, (n,), generator=g).tolist() for n in (5, 7, 4, 6, 40, 3, 8)]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    spec = SpeculativeConfig(algorithm="eagle", num_steps=2, topk=2, num_draft_tokens=4)

    def outputs(draft: bool, graphs: str):
        target, head = build_bigram_models(backend, layer_scale=0.1)
        llm = LLM.from_modules(
            target, head if draft else None, spec if draft else None, backend=backend,
            max_batch_size=8, max_context=256, graphs=graphs, max_tokens_per_step=96,
            prefill_chunk_size=96,
        )  # fmt: skip
        replays = []
        grouped = llm.worker._extend_grouped

        def spy(*a, **kw):
            out = grouped(*a, **kw)
            replays.append(out is not None)
            return out

        llm.worker._extend_grouped = spy
        outs = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
        return outs, replays

    for draft in (False, True):
        eager, _ = outputs(draft, "off")
        grouped, replays = outputs(draft, "on")
        assert grouped == eager
        assert replays and all(replays), replays  # target (and draft) prefill: grouped replays


def test_captures_run_with_the_collector_off():
    """``no_collection`` (what the cuda and npu graph runners capture under): the collector
    is off inside, and back as it was after, an exception included; left off when it was."""
    import gc

    from polyspec.backends.common.graph import no_collection

    assert gc.isenabled()
    with pytest.raises(RuntimeError), no_collection():
        assert not gc.isenabled()
        raise RuntimeError("a capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with no_collection():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
