"""The Ascend-shaped test backend enforces each constraint loudly (and is found by entry point).

The conformance suite proves the engine respects these constraints
(``pytest --pyargs polyspec.testing --polyspec-backend ascend-like``); these tests prove the
constraints are really enforced, so that passing the suite means something.
"""

from __future__ import annotations

import pytest
import torch
from plugin_packages import ensure_test_plugins_installed

from polyspec.backend import ForwardBatch, ForwardMode, TreeMaskMode
from polyspec.testing.ascend_like import PAGE_SIZE, AscendLikeBackend

I32, I64 = torch.int32, torch.int64


@pytest.fixture(scope="module")
def be() -> AscendLikeBackend:
    return AscendLikeBackend()


def test_registered_through_its_entry_point():
    from polyspec.plugins import create_backend, discover

    ensure_test_plugins_installed()
    report = next(r for r in discover() if r.name == "ascend-like")
    assert report.available and "polyspec-ascend-like" in report.to_dict()["distribution"]
    backend = create_backend("ascend-like")
    assert isinstance(backend, AscendLikeBackend)
    caps = backend.capabilities
    assert caps.index_dtype == "int32" and caps.graph_needs_prepare
    assert caps.page_sizes == (PAGE_SIZE,) and caps.max_graph_shapes == 8


def test_allocator_is_page_128_int32(be):
    with pytest.raises(ValueError, match="page_size 16"):
        be.make_allocator(16 * 8, 16)
    slots = be.make_allocator(PAGE_SIZE * 4, PAGE_SIZE).alloc(PAGE_SIZE)
    assert slots.dtype == I32 and slots.shape == (PAGE_SIZE,)


def test_kernels_and_pool_reject_int64_indices(be):
    table = torch.zeros(2, 8, dtype=I32)
    rows, start, end = (torch.tensor([x], dtype=I32) for x in (1, 0, 3))
    with pytest.raises(TypeError, match="slots is torch.int64"):
        be.kernels.assign_req_to_token(rows, table, start, end, torch.tensor([4, 5, 6]))
    be.kernels.assign_req_to_token(rows, table, start, end, torch.tensor([4, 5, 6], dtype=I32))
    assert table[1, :3].tolist() == [4, 5, 6]
    pool = be.make_kv_pool(4 * PAGE_SIZE, 1, 2, 8, torch.float32)
    with pytest.raises(TypeError, match="dst_loc"):
        pool.move(torch.tensor([4]), torch.tensor([1], dtype=I32))
    bs, n = 2, 3
    outs = dict(
        tree_mask=torch.empty(bs, n, n, dtype=torch.bool),
        positions=torch.empty(bs * n, dtype=I64),
        retrive_index=torch.empty(bs, n, dtype=I64),  # the wrong dtype
        retrive_next_token=torch.empty(bs, n, dtype=I32),
        retrive_next_sibling=torch.empty(bs, n, dtype=I32),
    )
    args = (
        torch.zeros(bs, 1, dtype=I64),
        torch.tensor([[0, 1]] * bs),
        torch.tensor([5, 9], dtype=I32),
    )
    with pytest.raises(TypeError, match="retrive_index"):
        be.kernels.build_tree(*args, 2, 1, n, TreeMaskMode.TREE_ONLY, **outs)
    outs["retrive_index"] = outs["retrive_index"].to(I32)
    be.kernels.build_tree(*args, 2, 1, n, TreeMaskMode.TREE_ONLY, **outs)
    assert outs["retrive_index"].tolist() == [[0, 1, 2], [3, 4, 5]]


def test_sampling_kernels_are_fp32_only(be):
    probs = torch.full((2, 4), 0.25)
    noise = torch.ones(2, 4)
    with pytest.raises(TypeError, match="sampling kernels accept only"):
        be.kernels.sample(probs.double(), noise.double())
    with pytest.raises(TypeError, match="probs is torch.bfloat16"):
        be.kernels.top_k_top_p_renorm(probs.bfloat16(), torch.tensor([0, 0]), torch.ones(2))
    assert be.kernels.sample(probs, noise).shape == (2,)
    links = torch.tensor([[0, 1], [2, 3]], dtype=I32)
    none = torch.full((2, 2), -1, dtype=I32)
    with pytest.raises(TypeError, match="target_probs"):
        be.kernels.verify_tree_sampling(
            torch.zeros(2, 2, dtype=I64), links, none, none, torch.full((2, 2, 4), 0.25).half(),
            None, torch.rand(2, 2), torch.rand(2), torch.empty(4, dtype=I64),
            torch.empty(2, 2, dtype=I32), torch.empty(2, dtype=I32),
        )  # fmt: skip


def _decode_batch(dtype=I32, **overrides) -> ForwardBatch:
    """One request, prefix 5 on page 2 (slots 256..260), decoding position 5 (slot 261)."""
    table = torch.zeros(2, 2 * PAGE_SIZE, dtype=dtype)
    table[1, :PAGE_SIZE] = torch.arange(2 * PAGE_SIZE, 3 * PAGE_SIZE, dtype=dtype)
    fields = dict(
        mode=ForwardMode.DECODE,
        input_ids=torch.tensor([7]),
        positions=torch.tensor([5]),
        out_cache_loc=torch.tensor([2 * PAGE_SIZE + 5], dtype=dtype),
        req_pool_indices=torch.tensor([1], dtype=dtype),
        req_to_token=table,
        prefix_lens=torch.tensor([5], dtype=dtype),
        extend_lens=torch.tensor([1], dtype=dtype),
        prefix_lens_cpu=[5],
        extend_lens_cpu=[1],
    )
    fields.update(overrides)
    return ForwardBatch(**fields)


def test_attention_rules(be):
    pool = be.make_kv_pool(4 * PAGE_SIZE, 1, 1, 8, torch.float32)
    attn = be.make_attention(pool, 2, 1, 8, 8**-0.5)
    attn.build_metadata(_decode_batch())  # the well-formed batch is accepted
    with pytest.raises(TypeError, match="int32"):
        attn.build_metadata(_decode_batch(I64, prefix_lens_cpu=[5], extend_lens_cpu=[1]))
    with pytest.raises(ValueError, match="prefix_lens_cpu is missing"):
        attn.build_metadata(_decode_batch(prefix_lens_cpu=None))
    with pytest.raises(ValueError, match="extend_lens_cpu is missing"):
        attn.build_metadata(_decode_batch(extend_lens_cpu=None))
    with pytest.raises(ValueError, match="disagrees"):
        attn.build_metadata(_decode_batch(prefix_lens_cpu=[4]))
    broken = _decode_batch()
    broken.req_to_token[1, 3] = 3 * PAGE_SIZE + 3  # position 3 leaves its page
    with pytest.raises(ValueError, match="block-table layout"):
        attn.build_metadata(broken)
    with pytest.raises(TypeError, match="loc"):
        pool.write(0, torch.tensor([3]), torch.ones(1, 1, 8), torch.ones(1, 1, 8))


def test_draft_decode_needs_lane_host_lens_and_page_aligned_prefix(be):
    pool = be.make_kv_pool(8 * PAGE_SIZE, 1, 1, 8, torch.float32)
    attn = be.make_attention(pool, 1, 1, 8, 1.0)
    lanes = torch.arange(3 * PAGE_SIZE, 5 * PAGE_SIZE, dtype=I32).view(1, 2, PAGE_SIZE)

    def batch(prefix: int, lane_lens_cpu):
        b = _decode_batch(
            mode=ForwardMode.DRAFT_DECODE,
            input_ids=torch.tensor([1, 2]),
            positions=torch.tensor([prefix + 2, prefix + 2]),
            out_cache_loc=lanes[0, :, 2].contiguous(),
            prefix_lens=torch.tensor([prefix], dtype=I32),
            extend_lens=torch.tensor([2], dtype=I32),
            prefix_lens_cpu=[prefix],
            extend_lens_cpu=[2],
            lane_locs=lanes,
            lane_lens=torch.tensor([3], dtype=I32),
            lane_lens_cpu=lane_lens_cpu,
            topk=2,
        )
        return b

    attn.build_metadata(batch(0, [3]))
    with pytest.raises(ValueError, match="lane_lens_cpu is missing"):
        attn.build_metadata(batch(0, None))
    with pytest.raises(ValueError, match="page boundary"):
        attn.build_metadata(batch(5, [3]))


def _compute(inputs):
    return {"y": inputs["x"] * 2}


def test_graph_replay_needs_prepare_and_shapes_are_limited(be):
    runner = be.make_graph_runner()
    x = torch.zeros(4)
    out = runner.capture("b4", _compute, {"x": x})
    with pytest.raises(RuntimeError, match="without prepare"):
        runner.replay("b4", {"x": torch.ones(4)})
    good = {"batch_size": 4, "max_prefix_len": 256, "seq_lens": [7, 0, 3, 1]}
    with pytest.raises(TypeError, match="host parameter"):
        runner.prepare("b4", {**good, "seq_lens": torch.tensor([7, 0, 3, 1])})
    for bad, match in (
        ({"max_prefix_len": 256, "seq_lens": [1]}, "batch_size"),
        ({**good, "batch_size": 5}, "batch_size"),  # more than the captured rows
        ({**good, "max_prefix_len": None}, "max_prefix_len"),
        ({"batch_size": 4, "max_prefix_len": 256}, "no per-request host lists"),
        ({**good, "seq_lens": [7, 0, 3]}, "batch_size = 4"),
        ({**good, "seq_lens": [7, 0, 3, -1]}, "non-negative"),
    ):
        with pytest.raises(ValueError, match=match):
            runner.prepare("b4", bad)
    runner.prepare("b4", good)
    runner.replay("b4", {"x": torch.ones(4)})
    assert out["y"].tolist() == [2.0] * 4
    with pytest.raises(RuntimeError, match="without prepare"):  # a prepare is used up
        runner.replay("b4", {"x": torch.ones(4)})
    for i in range(be.capabilities.max_graph_shapes - 1):
        runner.capture(f"k{i}", _compute, {"x": torch.zeros(4)})
    with pytest.raises(RuntimeError, match="graph shapes"):
        runner.capture("one-too-many", _compute, {"x": torch.zeros(4)})


def test_captured_forward_host_lengths_must_match_the_replay(be):
    """A captured forward's ``host_lengths`` of the prepared parameters must give its device
    lengths: the engine's side of the contract a real prepare relies on."""
    from polyspec.backend import HostLengths
    from polyspec.runtime.graphs import padded

    pool = be.make_kv_pool(5 * PAGE_SIZE, 1, 1, 16, torch.float32)
    attn = be.make_attention(pool, 2, 1, 16, 0.25)
    table = torch.arange(PAGE_SIZE, 5 * PAGE_SIZE, dtype=I32).view(2, 2 * PAGE_SIZE)

    def rule(params):  # the engine's form: committed lengths of the live requests, then 0
        live = len(params.get("seq_lens", ()))
        return HostLengths(padded(params, "seq_lens", 2), [1] * live + [0] * (2 - live))

    def decode(s, host_lengths=rule):
        batch = ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=torch.zeros(2, dtype=I64),
            positions=torch.zeros(2, dtype=I64),
            out_cache_loc=torch.zeros(2, dtype=I32),
            req_pool_indices=torch.tensor([0, 1], dtype=I32),
            req_to_token=table,
            prefix_lens=s["host"][:, 1].to(I32),
            extend_lens=(s["host"][:, 3] > 0).to(I32),
            host_lengths=host_lengths,
        )
        attn.build_static_metadata(batch, 256)
        return {"y": s["host"].float()}

    zeros = {"host": torch.zeros(2, 4, dtype=I64)}
    with pytest.raises(ValueError, match="host_lengths is missing"):
        decode(zeros, host_lengths=None)
    runner = be.make_graph_runner()
    runner.capture("k", decode, zeros)  # at capture: {} describes the zero inputs
    one = {"host": torch.tensor([[0, 5, 9, 1]])}  # one live request, committed length 5
    runner.prepare("k", {"batch_size": 1, "max_prefix_len": 256, "seq_lens": [5]})
    runner.replay("k", one)
    runner.prepare("k", {"batch_size": 1, "max_prefix_len": 256, "seq_lens": [6]})
    with pytest.raises(ValueError, match=r"host_lengths\(.*prefix_lens = \[6, 0\]"):
        runner.replay("k", one)
