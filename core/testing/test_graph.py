"""Conformance: graph capture / replay rules (real graphs and eager runners alike)."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch


def compute(inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A small fixed-shape computation: x [8, 4] float32, ids [8] index dtype."""
    x, ids = inputs["x"], inputs["ids"]
    y = torch.tanh(x) * 2 + ids[:, None].to(x.dtype)
    return {"y": y, "total": y.sum(0)}


def static_buffers(backend) -> dict[str, torch.Tensor]:
    dev = backend.device()
    return {
        "x": torch.zeros(8, 4, device=dev),
        "ids": torch.zeros(8, dtype=backend.index_dtype, device=dev),
    }


def replay(backend, runner, key, inputs):
    """Replay, calling prepare first where the backend's graphs need it (in the contract's
    form: ``GraphRunner.prepare``)."""
    if backend.capabilities.graph_needs_prepare:
        n = int(inputs["x"].shape[0])
        runner.prepare(key, {"batch_size": n, "max_prefix_len": 0, "seq_lens": [0] * n})
    return runner.replay(key, inputs)


def test_replay_matches_eager(backend):
    runner = backend.make_graph_runner()
    buffers = static_buffers(backend)
    assert not runner.can_run("b8")
    outputs = runner.capture("b8", compute, buffers)
    assert runner.can_run("b8") and not runner.can_run("b4")
    dev = backend.device()
    gen = torch.Generator().manual_seed(0)
    for n in (8, 5, 8):
        x = torch.randn(n, 4, generator=gen).to(dev)
        ids = torch.randint(0, 50, (n,), generator=gen).to(dev, backend.index_dtype)
        got = replay(backend, runner, "b8", {"x": x, "ids": ids})
        backend.synchronize()
        # Shorter inputs are padded with zeros in the static buffers.
        padded = static_buffers(backend)
        padded["x"][:n] = x
        padded["ids"][:n] = ids
        expected = compute(padded)
        torch.testing.assert_close(got["y"].cpu(), expected["y"].cpu())
        torch.testing.assert_close(got["total"].cpu(), expected["total"].cpu())
        # The outputs returned at capture are the static ones: they hold the new values too.
        torch.testing.assert_close(outputs["y"].cpu(), expected["y"].cpu())
        assert got["y"].data_ptr() == outputs["y"].data_ptr()
        # New values went through the very buffers given at capture.
        torch.testing.assert_close(buffers["x"].cpu(), padded["x"].cpu())


def test_replay_rules(backend):
    runner = backend.make_graph_runner()
    runner.capture("b8", compute, static_buffers(backend))
    dev, idx = backend.device(), backend.index_dtype
    ok = {"x": torch.ones(8, 4, device=dev), "ids": torch.ones(8, dtype=idx, device=dev)}
    with pytest.raises((KeyError, ValueError)):
        runner.replay("never-captured", ok)
    bad_inputs = [
        {"x": torch.ones(8, 4, device=dev), "typo": torch.ones(8, dtype=idx, device=dev)},
        {"x": torch.ones(9, 4, device=dev)},  # leading dim larger than the buffer
        {"x": torch.ones(8, 4, dtype=torch.float64, device=dev)},  # dtype
        {"x": torch.ones(8, 4, 1, device=dev)},  # rank
        {"x": torch.ones(8, 5, device=dev)},  # trailing dim
    ]
    for inputs in bad_inputs:
        with pytest.raises((ValueError, TypeError)):
            runner.replay("b8", inputs)
    # A rejected replay leaves the runner usable.
    out = replay(backend, runner, "b8", ok)
    torch.testing.assert_close(out["y"].cpu(), compute(ok)["y"].cpu())


def test_memory_info_is_free_and_total_bytes(backend):
    """``Backend.memory_info``: (free, total) bytes of the device with 0 <= free <= total, or
    (0, 0) where the backend cannot tell. The engine sizes the KV cache and stops capturing
    larger graph buckets by it, so a wrong figure fails or wastes memory there."""
    free, total = backend.memory_info()
    assert isinstance(free, int) and isinstance(total, int), (free, total)
    assert (free, total) == (0, 0) or 0 <= free <= total and total > 0, (free, total)
