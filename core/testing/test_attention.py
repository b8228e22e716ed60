"""Conformance: attention for every ForwardMode against a naive per-query oracle and the cpu
reference backend.

The oracle below is written independently of any backend: it keeps its own copy of the K/V
cache (updated with plain indexing), lists the slots each query may see straight from the
ForwardBatch docstrings, and runs softmax attention query by query in float64.
"""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch

from polyspec.backend import Backend, ForwardBatch, ForwardMode, HostLengths
from polyspec.testing.plugin import (
    NATIVE_PAGE_SIZE,
    default_page_size,
    require,
    resolve_page_size,
)

NUM_LAYERS = 2
HEAD_DIM = 16
NUM_SLOTS = 4096  # room for the draft lanes of 128-slot pages
MAX_REQUESTS = 6
MAX_CONTEXT = 96
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


# ----------------------------------------------------------------------------- slot layouts


class SlotSource:
    """Random, non-contiguous slots: shuffled single slots (page_size 1) or shuffled whole pages."""

    def __init__(self, page_size: int, gen: torch.Generator) -> None:
        self.page_size = page_size
        pages = torch.randperm(NUM_SLOTS // page_size - 1, generator=gen) + 1  # page 0 reserved
        self._pages = pages.tolist()

    def take(self, num_tokens: int) -> list[int]:
        """Slots for ``num_tokens`` consecutive positions (whole pages, page-aligned)."""
        ps = self.page_size
        n_pages = -(-num_tokens // ps)
        assert n_pages <= len(self._pages), "test layout ran out of slots"
        pages, self._pages = self._pages[:n_pages], self._pages[n_pages:]
        return [p * ps + i for p in pages for i in range(ps)][:num_tokens]


@dataclasses.dataclass
class Requests:
    """A batch's rows of req_to_token (random rows, random slots)."""

    rows: list[int]  # req_pool_indices
    req_to_token: torch.Tensor  # [MAX_REQUESTS, MAX_CONTEXT] int64 (host)


def make_requests(total_lens: list[int], slots: SlotSource, gen: torch.Generator) -> Requests:
    rows = torch.randperm(MAX_REQUESTS, generator=gen)[: len(total_lens)].tolist()
    rt = torch.zeros(MAX_REQUESTS, MAX_CONTEXT, dtype=torch.int64)
    for r, n in zip(rows, total_lens):
        rt[r, :n] = torch.tensor(slots.take(n), dtype=torch.int64)
    return Requests(rows, rt)


# ----------------------------------------------------------------------------- the oracle


class Oracle:
    """Shadow K/V cache and naive attention."""

    def __init__(self, dtype: torch.dtype, hq: int, hkv: int) -> None:
        shape = (NUM_LAYERS, NUM_SLOTS, hkv, HEAD_DIM)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        self.hq, self.hkv = hq, hkv
        self.scale = HEAD_DIM**-0.5

    def write(self, layer: int, loc: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        for i, s in enumerate(loc):
            self.k[layer, s] = k[i]
            self.v[layer, s] = v[i]

    def move(self, dst: list[int], src: list[int]) -> None:
        k_src = [self.k[:, s].clone() for s in src]
        v_src = [self.v[:, s].clone() for s in src]
        for d, ks, vs in zip(dst, k_src, v_src):
            self.k[:, d] = ks
            self.v[:, d] = vs

    def attend(self, layer: int, q: torch.Tensor, visible: list[list[int]]) -> torch.Tensor:
        """q [T, Hq, D]; visible[t] = slots token t sees -> [T, Hq, D] float64."""
        group = self.hq // self.hkv
        out = torch.empty(q.shape, dtype=torch.float64)
        for t, slots in enumerate(visible):
            idx = torch.tensor(slots, dtype=torch.int64)
            for h in range(self.hq):
                keys = self.k[layer, idx, h // group].double()  # [n, D]
                values = self.v[layer, idx, h // group].double()
                p = torch.softmax(keys @ q[t, h].double() * self.scale, 0)
                out[t, h] = p @ values
        return out


def visible_slots(batch: ForwardBatch) -> list[list[int]]:
    """For each token, the slots it may attend to (the ForwardMode contract, spelled out)."""
    rt = batch.req_to_token.cpu()
    rows = batch.req_pool_indices.tolist()
    prefix = batch.prefix_lens.tolist()
    extend = batch.extend_lens.tolist()
    out: list[list[int]] = []
    for b, r in enumerate(rows):
        p = prefix[b]
        prefix_slots = rt[r, :p].tolist()
        for i in range(extend[b]):
            mode = batch.mode
            if mode in (ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND, ForwardMode.DECODE):
                out.append(rt[r, : p + i + 1].tolist())
            elif mode is ForwardMode.TARGET_VERIFY:
                nodes = [j for j in range(extend[b]) if bool(batch.tree_mask[b, i, j])]
                out.append(prefix_slots + [int(rt[r, p + j]) for j in nodes])
            else:  # DRAFT_DECODE: token i is lane i of request b
                w = int(batch.lane_lens[b])
                out.append(prefix_slots + batch.lane_locs[b, i, :w].tolist())
    return out


# ----------------------------------------------------------------------------- harness


class Harness:
    """One pool + attention per backend (under test, reference) and the oracle, kept in sync."""

    def __init__(self, backends: list[Backend], dtype: torch.dtype, hq: int, hkv: int) -> None:
        self.sides = []
        for be in backends:
            pool = be.make_kv_pool(NUM_SLOTS, NUM_LAYERS, hkv, HEAD_DIM, dtype)
            attn = be.make_attention(pool, hq, hkv, HEAD_DIM, HEAD_DIM**-0.5)
            self.sides.append((be, pool, attn))
        self.oracle = Oracle(dtype, hq, hkv)
        self.dtype, self.hq, self.hkv = dtype, hq, hkv

    def fill(self, slots: list[int], gen: torch.Generator) -> None:
        """Random K/V at ``slots`` in every layer (the cached prefix)."""
        for layer in range(NUM_LAYERS):
            k, v = self.rand_kv(len(slots), gen)
            self.oracle.write(layer, slots, k, v)
            for be, pool, _ in self.sides:
                loc = torch.tensor(slots, dtype=be.index_dtype, device=be.device())
                pool.write(layer, loc, k.to(be.device()), v.to(be.device()))

    def move(self, dst: list[int], src: list[int]) -> None:
        self.oracle.move(dst, src)
        for be, pool, _ in self.sides:
            idx = be.index_dtype
            pool.move(
                torch.tensor(dst, dtype=idx, device=be.device()),
                torch.tensor(src, dtype=idx, device=be.device()),
            )

    def rand_kv(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (n, self.hkv, HEAD_DIM)
        return (
            torch.randn(shape, generator=gen).to(self.dtype),
            torch.randn(shape, generator=gen).to(self.dtype),
        )

    def run_and_check(self, batch: ForwardBatch, gen: torch.Generator) -> None:
        """Forward every layer on every side; compare with the oracle and across sides."""
        visible = visible_slots(batch)
        loc = batch.out_cache_loc.tolist()
        metas = [attn.build_metadata(on_device(batch, be)) for be, _, attn in self.sides]
        tol = TOLERANCE[self.dtype]
        for layer in range(NUM_LAYERS):
            q = torch.randn(len(loc), self.hq, HEAD_DIM, generator=gen).to(self.dtype)
            k, v = self.rand_kv(len(loc), gen)
            self.oracle.write(layer, loc, k, v)
            expected = self.oracle.attend(layer, q, visible)
            outputs = []
            for (be, pool, attn), meta in zip(self.sides, metas):
                dev = be.device()
                out = attn.forward(q.to(dev), k.to(dev), v.to(dev), layer, meta)
                assert out.shape == q.shape and out.dtype == q.dtype, (out.shape, out.dtype)
                outputs.append(out.cpu())
                # Every slot of the layer equals the oracle's cache: the new K/V landed at
                # out_cache_loc and nothing else moved (slot 0 is scratch).
                torch.testing.assert_close(pool.k_cache(layer)[1:].cpu(), self.oracle.k[layer, 1:])
                torch.testing.assert_close(pool.v_cache(layer)[1:].cpu(), self.oracle.v[layer, 1:])
            for out in outputs:
                torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
            torch.testing.assert_close(outputs[0], outputs[-1], atol=tol, rtol=tol)

    def run_and_check_static(self, batch: ForwardBatch, gen: torch.Generator) -> None:
        """As :meth:`run_and_check`, through ``build_static_metadata`` on the uniform, padded
        layout of a captured forward: ``Q = max(extend_lens)`` token rows per request and one
        padding request appended (row 0, lengths 0, slot 0)."""
        static, token_rows = to_static(batch)
        visible = visible_slots(batch)
        loc = batch.out_cache_loc.tolist()
        metas = [
            attn.build_static_metadata(on_device(static, be, host_lists=False), MAX_CONTEXT)
            for be, _, attn in self.sides
        ]
        tol = TOLERANCE[self.dtype]
        rows = torch.tensor(token_rows)
        t_static = static.num_tokens
        for layer in range(NUM_LAYERS):
            q = torch.randn(t_static, self.hq, HEAD_DIM, generator=gen).to(self.dtype)
            k, v = self.rand_kv(t_static, gen)
            self.oracle.write(layer, loc, k[rows], v[rows])
            expected = self.oracle.attend(layer, q[rows], visible)
            for (be, pool, attn), meta in zip(self.sides, metas):
                dev = be.device()
                out = attn.forward(q.to(dev), k.to(dev), v.to(dev), layer, meta)
                assert out.shape == q.shape and out.dtype == q.dtype, (out.shape, out.dtype)
                assert bool(out.isfinite().all()), "padding tokens must stay finite"
                torch.testing.assert_close(out.cpu()[rows].double(), expected, atol=tol, rtol=tol)
                torch.testing.assert_close(pool.k_cache(layer)[1:].cpu(), self.oracle.k[layer, 1:])
                torch.testing.assert_close(pool.v_cache(layer)[1:].cpu(), self.oracle.v[layer, 1:])


def to_static(batch: ForwardBatch) -> tuple[ForwardBatch, list[int]]:
    """``batch`` in the layout of a captured forward, plus the static row of each real token."""
    extend = batch.extend_lens.tolist()
    bs, q = len(extend), max(extend)
    big = bs + 1  # one padding request
    token_rows, start = [], 0
    input_ids = torch.zeros(big * q, dtype=torch.int64)
    positions = torch.zeros(big * q, dtype=torch.int64)
    out_cache_loc = torch.zeros(big * q, dtype=torch.int64)
    for b, e in enumerate(extend):
        for i in range(e):
            token_rows.append(b * q + i)
            input_ids[b * q + i] = batch.input_ids[start + i]
            positions[b * q + i] = batch.positions[start + i]
            out_cache_loc[b * q + i] = batch.out_cache_loc[start + i]
        start += e

    def pad(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        return torch.cat([t, torch.zeros((1, *t.shape[1:]), dtype=t.dtype)])

    static = dataclasses.replace(
        batch,
        input_ids=input_ids,
        positions=positions,
        out_cache_loc=out_cache_loc,
        req_pool_indices=pad(batch.req_pool_indices),
        prefix_lens=pad(batch.prefix_lens),
        extend_lens=pad(batch.extend_lens),
        tree_mask=pad(batch.tree_mask),
        lane_locs=pad(batch.lane_locs),
        lane_lens=pad(batch.lane_lens),
    )
    return static, token_rows


def on_device(batch: ForwardBatch, be: Backend, host_lists: bool = True) -> ForwardBatch:
    """``batch`` with index tensors in the backend's index dtype on its device."""
    dev, idx = be.device(), be.index_dtype

    def conv(t: torch.Tensor | None, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        return None if t is None else t.to(device=dev, dtype=dtype or t.dtype)

    return dataclasses.replace(
        batch,
        input_ids=conv(batch.input_ids),
        positions=conv(batch.positions),
        out_cache_loc=conv(batch.out_cache_loc, idx),
        req_pool_indices=conv(batch.req_pool_indices, idx),
        req_to_token=conv(batch.req_to_token, idx),
        prefix_lens=conv(batch.prefix_lens, idx),
        extend_lens=conv(batch.extend_lens, idx),
        tree_mask=conv(batch.tree_mask),
        lane_locs=conv(batch.lane_locs, idx),
        lane_lens=conv(batch.lane_lens, idx),
        prefix_lens_cpu=batch.prefix_lens.tolist() if host_lists else None,
        extend_lens_cpu=batch.extend_lens.tolist() if host_lists else None,
        lane_lens_cpu=None
        if batch.lane_lens is None or not host_lists
        else batch.lane_lens.tolist(),
        host_lengths=None if host_lists else captured_lengths(batch),
    )


def captured_lengths(batch: ForwardBatch):
    """A captured forward's ``host_lengths`` for ``batch`` as it is (``{}``, the capture's own
    inputs, is what a backend evaluates outside a graph runner's replay)."""
    lengths = HostLengths(
        batch.prefix_lens.tolist(),
        batch.extend_lens.tolist(),
        None if batch.lane_lens is None else batch.lane_lens.tolist(),
    )

    def host_lengths(host_params):
        if host_params:
            raise AssertionError(f"no prepare in this test, got host parameters {host_params}")
        return lengths

    return host_lengths


def random_tree_mask(n: int, gen: torch.Generator, chain: bool) -> torch.Tensor:
    """[n, n] bool: node j sees itself and its ancestors; node 0 is the root."""
    mask = torch.eye(n, dtype=torch.bool)
    for j in range(1, n):
        parent = j - 1 if chain else int(torch.randint(0, j, (1,), generator=gen))
        mask[j] |= mask[parent]
    return mask


# ----------------------------------------------------------------------------- batches

# (prefix_lens, extend_lens) per scenario; the mode decides what the new tokens see.
SCENARIOS = {
    "extend": (ForwardMode.EXTEND, [0, 17, 40], [7, 1, 12]),
    "decode_bs1": (ForwardMode.DECODE, [33], [1]),
    "decode_same_len": (ForwardMode.DECODE, [20, 20], [1, 1]),
    "decode": (ForwardMode.DECODE, [5, 17, 40], [1, 1, 1]),
    "target_verify_tree": (ForwardMode.TARGET_VERIFY, [3, 17, 40], [6, 6, 6]),
    "target_verify_chain": (ForwardMode.TARGET_VERIFY, [3, 30], [4, 4]),
    "draft_extend_fixed": (ForwardMode.DRAFT_EXTEND, [10, 17, 40], [4, 4, 4]),
    "draft_extend_accepted": (ForwardMode.DRAFT_EXTEND, [10, 17, 40], [3, 1, 4]),
}


def build_batch(
    mode: ForwardMode,
    prefix: list[int],
    extend: list[int],
    reqs: Requests,
    gen: torch.Generator,
    chain: bool,
) -> ForwardBatch:
    rt = reqs.req_to_token
    locs, positions = [], []
    for b, r in enumerate(reqs.rows):
        locs += rt[r, prefix[b] : prefix[b] + extend[b]].tolist()
        positions += list(range(prefix[b], prefix[b] + extend[b]))
    tree_mask, topk = None, 1
    if mode is ForwardMode.TARGET_VERIFY:
        tree_mask = torch.stack([random_tree_mask(extend[0], gen, chain) for _ in prefix])
        topk = 1 if chain else 2  # a chain's tree mask is causal; a tree's (K > 1) is not
    t = len(locs)
    return ForwardBatch(
        mode=mode,
        input_ids=torch.randint(0, 100, (t,), generator=gen),
        positions=torch.tensor(positions, dtype=torch.int64),
        out_cache_loc=torch.tensor(locs, dtype=torch.int64),
        req_pool_indices=torch.tensor(reqs.rows, dtype=torch.int64),
        req_to_token=rt,
        prefix_lens=torch.tensor(prefix, dtype=torch.int64),
        extend_lens=torch.tensor(extend, dtype=torch.int64),
        tree_mask=tree_mask,
        topk=topk,
    )


def backends_under_test(backend: Backend, reference_backend: Backend) -> list[Backend]:
    return [backend, reference_backend]


def require_dtype_and_page(backend: Backend, dtype_name: str, page_size: int | str) -> int:
    """Skip unless the backend has the dtype and the page size; returns the page size."""
    require(dtype_name in backend.capabilities.dtypes, f"dtype {dtype_name}")
    return resolve_page_size(backend, page_size)


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("page_size", [1, 16, NATIVE_PAGE_SIZE])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_attention_modes(backend, reference_backend, scenario, page_size, dtype_name):
    """Every mode, both slot layouts, both dtypes, GQA 6/2, different prefix lengths."""
    mode, prefix, extend = SCENARIOS[scenario]
    page_size = require_dtype_and_page(backend, dtype_name, page_size)
    if scenario == "target_verify_tree":
        require(backend.capabilities.tree_attention, "tree_attention (topk > 1 trees)")
    gen = torch.Generator().manual_seed(zlib.crc32(f"{scenario}/{page_size}/{dtype_name}".encode()))
    h = Harness(backends_under_test(backend, reference_backend), DTYPES[dtype_name], 6, 2)
    reqs = make_requests([p + e for p, e in zip(prefix, extend)], SlotSource(page_size, gen), gen)
    h.fill(
        [s for b, r in enumerate(reqs.rows) for s in reqs.req_to_token[r, : prefix[b]].tolist()],
        gen,
    )
    batch = build_batch(mode, prefix, extend, reqs, gen, chain=scenario.endswith("chain"))
    h.run_and_check(batch, gen)


@pytest.mark.parametrize("page_size", [1, 16, NATIVE_PAGE_SIZE])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_static_metadata_modes(backend, reference_backend, scenario, page_size):
    """Captured-forward metadata (fixed widths, device tensors only, a padding request) gives
    the oracle's attention for the real tokens and writes nothing outside their slots."""
    require(backend.capabilities.static_metadata, "static_metadata (captured forwards)")
    mode, prefix, extend = SCENARIOS[scenario]
    page_size = resolve_page_size(backend, page_size)
    if scenario == "target_verify_tree":
        require(backend.capabilities.tree_attention, "tree_attention (topk > 1 trees)")
    gen = torch.Generator().manual_seed(zlib.crc32(f"static/{scenario}/{page_size}".encode()))
    h = Harness(backends_under_test(backend, reference_backend), torch.float32, 6, 2)
    reqs = make_requests([p + e for p, e in zip(prefix, extend)], SlotSource(page_size, gen), gen)
    h.fill(
        [s for b, r in enumerate(reqs.rows) for s in reqs.req_to_token[r, : prefix[b]].tolist()],
        gen,
    )
    batch = build_batch(mode, prefix, extend, reqs, gen, chain=scenario.endswith("chain"))
    h.run_and_check_static(batch, gen)


@pytest.mark.parametrize("heads", [(4, 4), (4, 1), (9, 3)])
def test_attention_head_layouts(backend, reference_backend, heads):
    """MHA, MQA and GQA 9/3 (SmolLM2's ratio) on a verify tree and on decode."""
    require(backend.capabilities.tree_attention, "tree_attention (topk > 1 trees)")
    hq, hkv = heads
    gen = torch.Generator().manual_seed(hq * 10 + hkv)
    for mode, prefix, extend in (
        SCENARIOS["target_verify_tree"],
        SCENARIOS["decode"],
    ):
        h = Harness(backends_under_test(backend, reference_backend), torch.float32, hq, hkv)
        source = SlotSource(default_page_size(backend), gen)
        reqs = make_requests([p + e for p, e in zip(prefix, extend)], source, gen)
        prefix_slots = [
            s for b, r in enumerate(reqs.rows) for s in reqs.req_to_token[r, : prefix[b]].tolist()
        ]
        h.fill(prefix_slots, gen)
        h.run_and_check(build_batch(mode, prefix, extend, reqs, gen, chain=False), gen)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("page_size", [1, 16, NATIVE_PAGE_SIZE])
@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_draft_decode_steps(backend, reference_backend, page_size, dtype_name, static):
    """S draft steps with K lanes per request; with pages each lane starts with a copy of the
    prefix's partial last page (the page_size > 1, topk > 1 layout of assign_draft_cache_locs)."""
    page_size = require_dtype_and_page(backend, dtype_name, page_size)
    if static:
        require(backend.capabilities.static_metadata, "static_metadata (captured forwards)")
    topk, num_steps = 3, 3
    seq_lens = [5, 21, 38]
    gen = torch.Generator().manual_seed(7 + page_size)
    h = Harness(backends_under_test(backend, reference_backend), DTYPES[dtype_name], 6, 2)
    source = SlotSource(page_size, gen)
    reqs = make_requests(seq_lens, source, gen)
    rt = reqs.req_to_token
    h.fill([s for b, r in enumerate(reqs.rows) for s in rt[r, : seq_lens[b]].tolist()], gen)
    if page_size == 1:
        width = num_steps
        tails = [0] * len(seq_lens)
    else:
        width = page_size * -(-(page_size - 1 + num_steps) // page_size)
        tails = [n % page_size for n in seq_lens]
    lane_locs = torch.tensor(
        [[source.take(width) for _ in range(topk)] for _ in seq_lens], dtype=torch.int64
    )  # [bs, K, W]
    dst, src = [], []
    for b, r in enumerate(reqs.rows):
        for lane in range(topk):
            for j in range(tails[b]):
                src.append(int(rt[r, seq_lens[b] - tails[b] + j]))
                dst.append(int(lane_locs[b, lane, j]))
    if dst:
        h.move(dst, src)
    # The lanes' shared prefix stops at the page boundary; the tail is each lane's own copy.
    prefix = [n - t for n, t in zip(seq_lens, tails)]
    bs = len(seq_lens)
    for step in range(num_steps):
        lane_lens = torch.tensor([t + step + 1 for t in tails], dtype=torch.int64)
        out_loc = lane_locs[
            torch.arange(bs)[:, None], torch.arange(topk)[None, :], (lane_lens - 1)[:, None]
        ]
        batch = ForwardBatch(
            mode=ForwardMode.DRAFT_DECODE,
            input_ids=torch.randint(0, 100, (bs * topk,), generator=gen),
            positions=torch.tensor([n + step for n in seq_lens for _ in range(topk)]),
            out_cache_loc=out_loc.reshape(-1),
            req_pool_indices=torch.tensor(reqs.rows, dtype=torch.int64),
            req_to_token=rt,
            prefix_lens=torch.tensor(prefix, dtype=torch.int64),
            extend_lens=torch.full((bs,), topk, dtype=torch.int64),
            lane_locs=lane_locs,
            lane_lens=lane_lens,
            topk=topk,
        )
        if static:
            h.run_and_check_static(batch, gen)
        else:
            h.run_and_check(batch, gen)
