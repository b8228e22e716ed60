"""The cuda backend's row-invariant kernels (kernels/triton/linear.py, list_attention.py):
right values, and a token's result bitwise independent of the other tokens of its forward.
Under ``TRITON_INTERPRET=1`` here (numpy arithmetic, so the invariance checked is the kernels'
logic: fixed tiles, no data-dependent grouping); compiled on the GPU by ci/device_cuda.sh,
where it is the hardware's arithmetic that is checked."""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch
import torch.nn.functional as F

from polyspec.backend import ForwardBatch, ForwardMode
from polyspec.backends.common import SDPAAttention, TensorKVPool
from polyspec.backends.cpu.backend import CPUBackend
from polyspec.backends.cuda.attention import RowInvariantAttention, key_lists_from
from polyspec.kernels.triton.linear import row_invariant_linear
from polyspec.kernels.triton.list_attention import (
    list_attention,
    static_key_lists,
)
from polyspec.testing.test_attention import (
    MAX_CONTEXT,
    NUM_SLOTS,
    SCENARIOS,
    SlotSource,
    build_batch,
    make_requests,
    on_device,
    to_static,
    visible_slots,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _gen(name: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(name.encode()))


# ----------------------------------------------------------------------------- linear


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("m,n,k", [(1, 64, 64), (5, 100, 70), (37, 130, 200), (16, 48, 576)])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_linear_values(triton_device, dtype, m, n, k, bias):
    """Against a float64 product of the same inputs: within one rounding of the output dtype
    (fp32: exact products, no TF32), for K and N that are not multiples of the tiles."""
    gen = _gen(f"lin/{dtype}/{m}/{n}/{k}/{bias}")
    dt = DTYPES[dtype]
    x = torch.randn(m, k, generator=gen).to(dt)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dt)
    b = torch.randn(n, generator=gen).to(dt) if bias else None
    dev = triton_device
    y = row_invariant_linear(x.to(dev), w.to(dev), None if b is None else b.to(dev)).cpu()
    assert y.shape == (m, n) and y.dtype == dt
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dt]
    torch.testing.assert_close(y.double(), exact, atol=tol, rtol=tol)


@pytest.mark.parametrize("m,n,k", [(3, 40, 2100), (2, 16400, 2048)], ids=["layer", "wide"])
def test_linear_tiles_of_large_weights(triton_device, m, n, k):
    """bf16 values with the tiles of an 8B model's weights (k >= 2048: a layer's narrow tile
    with 5 loads in flight, a wide weight's 64x256; recorded for the sm_90 compile check)."""
    gen = _gen(f"linbig/{m}/{n}/{k}")
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) / k**0.5).bfloat16()
    y = row_invariant_linear(x.to(triton_device), w.to(triton_device)).cpu()
    exact = F.linear(x.double(), w.double())
    torch.testing.assert_close(y.double(), exact, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_linear_rows_do_not_depend_on_the_batch(triton_device, dtype):
    """Each row of a 37-row call equals, bitwise, that row computed alone, in a 6-row call at
    another position, and in a permuted batch: what keeps verify rows equal to decode rows."""
    gen = _gen(f"lininv/{dtype}")
    dt = DTYPES[dtype]
    dev = triton_device
    x = torch.randn(37, 200, generator=gen).to(dt).to(dev)
    w = (torch.randn(130, 200, generator=gen) / 14).to(dt).to(dev)
    b = torch.randn(130, generator=gen).to(dt).to(dev)
    y = row_invariant_linear(x, w, b)
    for i in (0, 5, 16, 36):
        assert torch.equal(row_invariant_linear(x[i : i + 1], w, b), y[i : i + 1]), i
    assert torch.equal(row_invariant_linear(x[10:16], w, b), y[10:16])
    perm = torch.randperm(37, generator=gen).to(dev)
    assert torch.equal(row_invariant_linear(x[perm], w, b), y[perm])


def test_linear_shapes_and_errors(triton_device):
    dev = triton_device
    w = torch.randn(8, 16).to(dev)
    y = row_invariant_linear(torch.randn(2, 3, 16).to(dev), w)
    assert y.shape == (2, 3, 8)
    assert row_invariant_linear(torch.randn(0, 16).to(dev), w).shape == (0, 8)
    with pytest.raises(ValueError, match="x has 15 features but the weight"):
        row_invariant_linear(torch.randn(2, 15).to(dev), w)
    with pytest.raises(ValueError, match="must share one of"):
        row_invariant_linear(torch.randn(2, 16).to(dev).bfloat16(), w)
    with pytest.raises(ValueError, match="bias must be"):
        row_invariant_linear(torch.randn(2, 16).to(dev), w, torch.randn(7).to(dev))


# ----------------------------------------------------------------------------- attention


def test_list_attention_rows_do_not_depend_on_the_batch(triton_device):
    """A token's output is bitwise the output of the same key list attended alone, with its
    keys stored in other slots (a verify row against the decode step at its position), for
    lists shorter and longer than one 64-key block."""
    gen = _gen("listinv")
    dev = triton_device
    slots, hq, hkv, d = 600, 9, 3, 64
    k_cache = torch.randn(slots, hkv, d, generator=gen).bfloat16()
    v_cache = torch.randn(slots, hkv, d, generator=gen).bfloat16()
    lens = [1, 5, 64, 65, 130, 7]
    lists = torch.zeros(len(lens), max(lens), dtype=torch.int64)
    for t, n in enumerate(lens):
        lists[t, :n] = torch.randperm(300, generator=gen)[:n]
    q = torch.randn(len(lens), hq, d, generator=gen).bfloat16()
    key_lens = torch.tensor(lens, dtype=torch.int32)
    out = list_attention(
        q.to(dev), k_cache.to(dev), v_cache.to(dev), lists.to(dev), key_lens.to(dev), 0.125
    ).cpu()
    ref = _attend_float64(q, k_cache, v_cache, lists, lens, 0.125)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    for t, n in enumerate(lens):
        # the same keys copied to slots 300.. (another request's pages), attended alone
        moved_k, moved_v = k_cache.clone(), v_cache.clone()
        new = torch.arange(300, 300 + n)
        moved_k[new], moved_v[new] = k_cache[lists[t, :n]], v_cache[lists[t, :n]]
        alone = list_attention(
            q[t : t + 1].to(dev),
            moved_k.to(dev),
            moved_v.to(dev),
            new[None].to(dev),
            torch.tensor([n], dtype=torch.int32).to(dev),
            0.125,
        ).cpu()
        assert torch.equal(alone[0], out[t]), t


def _attend_float64(q, k_cache, v_cache, lists, lens, scale) -> torch.Tensor:
    group = q.shape[1] // k_cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for t, n in enumerate(lens):
        idx = lists[t, :n]
        for h in range(q.shape[1]):
            keys = k_cache[idx, h // group].double()
            p = torch.softmax(keys @ q[t, h].double() * scale, 0)
            out[t, h] = p @ v_cache[idx, h // group].double()
    return out


def _to(batch, dev, strided: bool = False):
    """``batch``'s tensors on ``dev`` (the Triton kernels' device); ``strided``: the
    per-request tensors as the columns of one [bs, 4] tensor, strided views as a worker's
    transposed upload makes them."""
    fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    out = {k: v.to(dev) for k, v in fields.items() if isinstance(v, torch.Tensor)}
    if strided:
        names = ["req_pool_indices", "prefix_lens", "extend_lens", "lane_lens"]
        names = [n for n in names if out.get(n) is not None]
        packed = torch.stack([out[n] for n in names], 1).contiguous()  # [bs, len(names)]
        out.update({n: packed[:, i] for i, n in enumerate(names)})
        assert out["prefix_lens"].stride(0) == len(names)
    return dataclasses.replace(batch, **out)


def _draft_decode_batch(gen: torch.Generator, lane_lens: list[int]):
    """A DRAFT_DECODE batch of three requests with K = 3 lanes of width 5."""
    prefix, topk, width = [4, 19, 0], 3, 5
    reqs = make_requests([p + 1 for p in prefix], SlotSource(16, gen), gen)
    bs = len(prefix)
    lane_locs = torch.randint(1, 900, (bs, topk, width), generator=gen)
    lens = torch.tensor(lane_lens)
    return ForwardBatch(
        mode=ForwardMode.DRAFT_DECODE,
        input_ids=torch.zeros(bs * topk, dtype=torch.int64),
        positions=torch.zeros(bs * topk, dtype=torch.int64),
        out_cache_loc=lane_locs.gather(2, (lens - 1).view(bs, 1, 1).expand(bs, topk, 1)).flatten(),
        req_pool_indices=torch.tensor(reqs.rows),
        req_to_token=reqs.req_to_token,
        prefix_lens=torch.tensor(prefix),
        extend_lens=torch.full((bs,), topk),
        lane_locs=lane_locs,
        lane_lens=lens,
        topk=topk,
    )


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("scenario", [*SCENARIOS, "draft_decode"])
def test_key_lists_are_the_visible_slots_in_order(triton_device, scenario, static):
    """The lists of an eager forward (from SDPA's layout) and of a captured one (one kernel,
    :func:`static_key_lists`) are, token by token, the slots the ForwardMode contract makes
    visible, in attention order: the prefix, then the block's visible tokens (a verify row's
    ancestors, root first; a draft lane's own slots). A captured forward's list equals the one
    SDPA's static layout gives, also for the tokens past a request's extend length; its
    padding request's tokens see slot 0 alone."""
    gen = _gen(f"lists/{scenario}")
    if scenario == "draft_decode":
        mode, batch = ForwardMode.DRAFT_DECODE, _draft_decode_batch(gen, [2, 5, 1])
        prefix = batch.prefix_lens.tolist()
    else:
        mode, prefix, extend = SCENARIOS[scenario]
        reqs = make_requests([p + e for p, e in zip(prefix, extend)], SlotSource(16, gen), gen)
        batch = build_batch(mode, prefix, extend, reqs, gen, chain=scenario.endswith("chain"))
    backend = CPUBackend()
    pool = TensorKVPool(1000, 1, 2, 8, torch.float32, "cpu")
    attn = RowInvariantAttention(pool, 4, 2, 8, 0.5)
    expected = visible_slots(batch)
    if static:
        static_batch, rows = to_static(batch)
        on_cpu = on_device(static_batch, backend, False)
        meta = attn.build_static_metadata(_to(on_cpu, triton_device, True), MAX_CONTEXT)
        lists, lens = meta.key_lists.cpu(), meta.key_lens.cpu()
        # SDPA's static layout, turned into lists by device ops: the same list for every token
        # of a real request (rows past a request's extend length included).
        layout = SDPAAttention._build_static_metadata(attn, on_cpu, MAX_CONTEXT)
        want_lists, want_lens = key_lists_from(layout)
        q = on_cpu.num_tokens // on_cpu.batch_size
        for t in range((on_cpu.batch_size - 1) * q):
            n = int(want_lens[t])
            assert int(lens[t]) == n and torch.equal(lists[t, :n], want_lists[t, :n]), t
        for t in range((on_cpu.batch_size - 1) * q, on_cpu.num_tokens):  # the padding request
            assert int(lens[t]) == 1 and int(lists[t, 0]) == 0, t
    else:
        rows = list(range(batch.num_tokens))
        meta = attn.build_metadata(on_device(batch, backend))
        lists, lens = key_lists_from(meta)
        assert torch.equal(lists, meta.key_lists) and torch.equal(lens, meta.key_lens)
    for t, row in enumerate(rows):
        n = int(lens[row])
        assert lists[row, :n].tolist() == expected[t], (scenario, t)
    if mode is ForwardMode.TARGET_VERIFY:
        assert max(int(lens[r]) for r in rows) > max(prefix)  # ancestors are in the lists


def test_static_key_lists_errors(triton_device):
    """A captured verify without its tree mask, or a draft decode without lanes, is refused
    with the field named."""
    gen = _gen("lists/errors")
    mode, prefix, extend = SCENARIOS["target_verify_tree"]
    reqs = make_requests([p + e for p, e in zip(prefix, extend)], SlotSource(16, gen), gen)
    batch = build_batch(mode, prefix, extend, reqs, gen, chain=False)
    with pytest.raises(ValueError, match="tree_mask"):
        static_key_lists(_to(dataclasses.replace(batch, tree_mask=None), triton_device), 64)
    dd = _draft_decode_batch(gen, [1, 1, 1])
    with pytest.raises(ValueError, match="lane_locs"):
        static_key_lists(_to(dataclasses.replace(dd, lane_locs=None), triton_device), 64)
    with pytest.raises(ValueError, match="T = bs"):
        static_key_lists(
            _to(dataclasses.replace(dd, input_ids=dd.input_ids[:-1]), triton_device), 64
        )


@pytest.mark.parametrize("scenario", ["decode", "target_verify_tree", "extend"])
def test_rotary_in_forward_equals_rotary_then_forward(triton_device, scenario):
    """``RowInvariantAttention(rotary_in_forward=True)``, handed q and k before rotary
    embedding, attends and fills the cache bitwise as the Triton ``rotary_embedding`` followed
    by the attention's plain forward (the model takes this path on the cuda backend)."""
    from polyspec.backend import Rotary
    from polyspec.kernels.triton.rope import rotary_embedding

    gen = _gen(f"rotary/{scenario}")
    mode, prefix, extend = SCENARIOS[scenario]
    reqs = make_requests([p + e for p, e in zip(prefix, extend)], SlotSource(16, gen), gen)
    batch = build_batch(mode, prefix, extend, reqs, gen, chain=False)
    pools, outs = [], []
    for fused in (True, False):
        pool = TensorKVPool(NUM_SLOTS, 1, 2, 16, torch.float32, triton_device)
        attn = RowInvariantAttention(pool, 4, 2, 16, 0.25, rotary_in_forward=fused)
        meta = attn.build_metadata(_to(on_device(batch, CPUBackend()), triton_device))
        g = _gen(f"rotary/{scenario}/qkv")
        for layer_cache in (pool.k_cache(0), pool.v_cache(0)):  # the prefix's keys and values
            layer_cache.copy_(torch.randn(layer_cache.shape, generator=g))
        qkv = torch.randn(batch.num_tokens, 8, 16, generator=g).to(triton_device)
        q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
        cache = torch.randn(MAX_CONTEXT, 16, generator=g).to(triton_device)
        positions = batch.positions.to(triton_device)
        if fused:
            out = attn.forward(q, k, v, 0, meta, rotary=Rotary(positions, cache, True))
        else:
            q, k = rotary_embedding(positions, q, k, cache, True)
            out = attn.forward(q, k, v, 0, meta)
        pools.append(pool)
        outs.append(out.cpu())
    assert torch.equal(outs[0], outs[1])
    for cache_of in ("k_cache", "v_cache"):
        a, b = (getattr(p, cache_of)(0).cpu() for p in pools)
        assert torch.equal(a, b), cache_of
