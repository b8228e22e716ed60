"""Conformance: KV pool writes and moves (every layer, overlapping move lists).

``KVPool.move`` is the one owner of K/V compaction (the engine calls it every speculative
round), so its overlap safety is checked here in every dtype the backend supports."""

from __future__ import annotations

import pytest
import torch

from polyspec.testing.plugin import require

NUM_SLOTS, NUM_LAYERS, HKV, HEAD_DIM = 40, 3, 2, 8


def make_pool(backend, dtype_name: str):
    require(dtype_name in backend.capabilities.dtypes, f"dtype {dtype_name}")
    pool = backend.make_kv_pool(NUM_SLOTS, NUM_LAYERS, HKV, HEAD_DIM, getattr(torch, dtype_name))
    assert pool.num_slots == NUM_SLOTS and pool.num_layers == NUM_LAYERS
    return pool


def snapshot(pool) -> tuple[torch.Tensor, torch.Tensor]:
    """All layers on the host: ([L, slots, Hkv, D], [L, slots, Hkv, D])."""
    ks = torch.stack([pool.k_cache(i).cpu() for i in range(NUM_LAYERS)])
    vs = torch.stack([pool.v_cache(i).cpu() for i in range(NUM_LAYERS)])
    return ks, vs


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "float16"])
def test_zero_init_and_write_round_trip(backend, dtype_name):
    pool = make_pool(backend, dtype_name)
    dtype = getattr(torch, dtype_name)
    for layer in range(NUM_LAYERS):
        assert pool.k_cache(layer).shape == (NUM_SLOTS, HKV, HEAD_DIM)
        assert pool.k_cache(layer).dtype == dtype
        assert not pool.k_cache(layer).cpu().any() and not pool.v_cache(layer).cpu().any()
    gen = torch.Generator().manual_seed(0)
    expected_k, expected_v = snapshot(pool)
    for layer in range(NUM_LAYERS):
        loc = torch.randperm(NUM_SLOTS - 1, generator=gen)[:7] + 1
        k = torch.randn(7, HKV, HEAD_DIM, generator=gen).to(dtype)
        v = torch.randn(7, HKV, HEAD_DIM, generator=gen).to(dtype)
        dev = backend.device()
        pool.write(layer, loc.to(dev, backend.index_dtype), k.to(dev), v.to(dev))
        expected_k[layer, loc] = k
        expected_v[layer, loc] = v
    got_k, got_v = snapshot(pool)
    assert torch.equal(got_k, expected_k) and torch.equal(got_v, expected_v)


@pytest.mark.parametrize(
    "dst,src",
    [
        ([2, 3, 4, 5], [1, 2, 3, 4]),  # shift right: every destination is a later source
        ([1, 2, 3], [2, 3, 4]),  # shift left
        ([7, 9, 11], [11, 7, 9]),  # a cycle
        ([20, 21], [20, 5]),  # a no-op entry next to a real one
        ([5, 6, 7, 4, 12, 11], [4, 5, 6, 20, 11, 12]),  # a shift, a move and a swap at once
    ],
)
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_move_is_gather_then_scatter(backend, dst, src, dtype_name):
    pool = make_pool(backend, dtype_name)
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(1)
    dev, idx = backend.device(), backend.index_dtype
    everything = torch.arange(1, NUM_SLOTS)
    for layer in range(NUM_LAYERS):
        k = torch.randn(NUM_SLOTS - 1, HKV, HEAD_DIM, generator=gen).to(dtype)
        v = torch.randn(NUM_SLOTS - 1, HKV, HEAD_DIM, generator=gen).to(dtype)
        pool.write(layer, everything.to(dev, idx), k.to(dev), v.to(dev))
    before_k, before_v = snapshot(pool)
    pool.move(torch.tensor(dst, dtype=idx, device=dev), torch.tensor(src, dtype=idx, device=dev))
    expected_k, expected_v = before_k.clone(), before_v.clone()
    expected_k[:, dst] = before_k[:, src]
    expected_v[:, dst] = before_v[:, src]
    got_k, got_v = snapshot(pool)
    assert torch.equal(got_k, expected_k) and torch.equal(got_v, expected_v)


def test_empty_move_and_write(backend):
    pool = make_pool(backend, "float32")
    dev, idx = backend.device(), backend.index_dtype
    empty = torch.empty(0, dtype=idx, device=dev)
    pool.move(empty, empty)
    pool.write(
        0,
        empty,
        torch.empty(0, HKV, HEAD_DIM, device=dev),
        torch.empty(0, HKV, HEAD_DIM, device=dev),
    )
    ks, vs = snapshot(pool)
    assert not ks.any() and not vs.any()
