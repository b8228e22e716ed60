"""Conformance: ``Backend.read_async`` (device -> host copies the engine reads its tokens with,
and with ``overlap_rounds`` queues the next round behind) and ``Backend.host_tensor`` (the
uploads of host integers it builds rounds from)."""

from __future__ import annotations

import pytest
import torch


def _after_busy_work(backend, values: torch.Tensor) -> torch.Tensor:  # [n] -> [n] on device
    """``values`` on the device, computed behind some queued work, so that a copy not ordered
    after it (a wrong stream, a host read too early) would see a stale tensor."""
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(0)).to(backend.device())
    for _ in range(8):
        x = torch.tanh(x @ x)  # bounded, so the zero below is exact
    return values.to(backend.device()) + (x.sum() * 0).to(values.dtype)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32])
def test_read_async_copies_the_value_at_its_point_in_the_queue(backend, dtype):
    t = _after_busy_work(backend, torch.arange(16).to(dtype))
    first = backend.read_async(t)
    t.add_(100)  # queued after the read: must not reach its copy
    second = backend.read_async(t)
    t.add_(100)
    a, b = first.wait(), second.wait()
    assert a.device.type == "cpu" and a.dtype == dtype and tuple(a.shape) == (16,)
    assert a.tolist() == torch.arange(16).to(dtype).tolist()
    assert b.tolist() == (torch.arange(16) + 100).to(dtype).tolist()
    assert first.wait() is a  # waiting again gives the same copy


def test_two_reads_outstanding_keep_their_values(backend):
    """The engine's pattern with ``overlap_rounds``: a round's read, and the read of the round
    queued behind it, both in flight; each is waited for before the next round is queued.
    Each host copy must hold its own value until then (a backend reusing host buffers must not
    hand one out while a read in it is outstanding)."""
    t = _after_busy_work(backend, torch.zeros(8, dtype=torch.int64))
    pending = [backend.read_async(t)]
    for step in range(1, 12):
        t.add_(1)
        pending.append(backend.read_async(t))
        value = pending.pop(0).wait()
        assert value.tolist() == [step - 1] * 8, f"read {step - 1} got {value.tolist()}"
    assert pending.pop().wait().tolist() == [11] * 8


def test_async_host_reads_imply_async_execution(backend):
    """A backend whose reads return before the copy is done runs its kernels asynchronously
    too (else there is nothing to overlap with, and ``overlap_rounds = "auto"`` would only add
    host work)."""
    caps = backend.capabilities
    assert not caps.async_host_reads or caps.async_execution


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_host_tensor_from_a_list_or_a_cpu_tensor(backend, dtype):
    """The same device tensor from a list and from a CPU tensor of another dtype (the engine
    hands structured output's int32 mask words as a tensor), behind queued work; the result
    keeps its values when the source is changed afterwards."""
    values = [3, -1, 2**31 - 1, -(2**31), 0, 7]
    source = torch.tensor(values, dtype=torch.int64)
    _after_busy_work(backend, torch.zeros(1))
    from_list = backend.host_tensor(values, dtype)
    from_tensor = backend.host_tensor(source, dtype)
    source.fill_(5)
    for t in (from_list, from_tensor):
        assert t.device.type == backend.device().type and t.dtype == dtype
        assert t.cpu().tolist() == values


def test_host_tensor_of_floats(backend):
    """float32 values from a CPU tensor (a sampled round's settings), exact, behind queued
    work, not sharing the source's memory."""
    values = [0.7, 50.0, 0.95, 1.0, 1e-6, 0.0]
    source = torch.tensor(values, dtype=torch.float32)
    _after_busy_work(backend, torch.zeros(1))
    t = backend.host_tensor(source, torch.float32)
    source.fill_(5)
    assert t.device.type == backend.device().type and t.dtype == torch.float32
    assert torch.equal(t.cpu(), torch.tensor(values, dtype=torch.float32))
