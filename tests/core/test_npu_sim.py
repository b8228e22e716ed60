"""The torch_npu simulator is strict where the real operators are, and its NPU graphs replay
with exactly the parameters a task-group update gave them (polyspec.backends.npu.sim)."""

from __future__ import annotations

import sys

import pytest
import torch

from polyspec.backends.npu.sim import NPUContractError, simulated

P = 128


@pytest.fixture
def npu():
    with simulated() as sim:
        yield sys.modules["torch_npu"], sim


def _caches(blocks: int = 4, hkv: int = 2, d: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(blocks, P, hkv, d, generator=g).to(torch.bfloat16)
    v = torch.randn(blocks, P, hkv, d, generator=g).to(torch.bfloat16)
    return k, v


def _reference(q, k_rows, v_rows, scale, visible):  # q [n, Hq, D], rows [kv, Hkv, D]
    group = q.shape[1] // k_rows.shape[1]
    k = k_rows.float().repeat_interleave(group, 1)
    v = v_rows.float().repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    s = s.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)


def _causal():
    return torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1)


def _fia_args(table, kv_lens, q_cum, **over):
    kwargs = dict(
        block_table=table, block_size=P, num_heads=4, num_key_value_heads=2, scale=0.25,
        actual_seq_lengths=q_cum, actual_seq_lengths_kv=kv_lens, input_layout="TND",
        sparse_mode=3, atten_mask=_causal(),
    )  # fmt: skip
    kwargs.update(over)
    return kwargs


def test_fused_attention_tnd_causal_matches_the_reference(npu):
    torch_npu, _ = npu
    kc, vc = _caches()
    table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    q = torch.randn(5, 4, 16).to(torch.bfloat16)  # request 0: 3 queries, request 1: 2
    kv = [130, 7]
    out, _ = torch_npu.npu_fused_infer_attention_score(
        q, kc.view(4, P, -1), vc.view(4, P, -1), **_fia_args(table, kv, [3, 5])
    )
    for b, (start, n) in enumerate([(0, 3), (3, 2)]):
        rows = kc[table[b].long()].reshape(-1, 2, 16)[: kv[b]]
        vrows = vc[table[b].long()].reshape(-1, 2, 16)[: kv[b]]
        vis = torch.arange(kv[b])[None, :] <= (kv[b] - n + torch.arange(n))[:, None]
        want = _reference(q[start : start + n], rows, vrows, 0.25, vis)
        torch.testing.assert_close(out[start : start + n].float(), want, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize(
    "over, message",
    [
        (dict(block_table=torch.tensor([[2, 0], [1, 3]])), "int32"),
        (dict(actual_seq_lengths=torch.tensor([3, 5])), "host list"),
        (dict(actual_seq_lengths=[5, 3]), "non-decreasing cumulative"),
        (dict(atten_mask=torch.ones(128, 128, dtype=torch.bool).triu(1)), r"\(2048, 2048\)"),
        (dict(atten_mask=torch.ones(2048, 2048, dtype=torch.bool).tril()), "upper-triangular"),
        (dict(sparse_mode=2), "sparse_mode 2"),
        (dict(block_size=16), "multiple of 128"),
        (dict(num_key_value_heads=3), "multiple of num_key_value_heads"),
        (dict(actual_seq_lengths_kv=None), "actual_seq_lengths_kv"),
        (dict(actual_seq_lengths_kv=[300, 7]), "columns"),
        (dict(actual_seq_lengths_kv=[2, 7]), "queries <= keys"),
    ],
)
def test_fused_attention_rejects_what_the_documentation_rules_out(npu, over, message):
    torch_npu, _ = npu
    kc, vc = _caches()
    q = torch.randn(5, 4, 16).to(torch.bfloat16)
    kwargs = _fia_args(torch.tensor([[2, 0], [1, 3]], dtype=torch.int32), [130, 7], [3, 5])
    kwargs.update(over)
    with pytest.raises(NPUContractError, match=message):
        torch_npu.npu_fused_infer_attention_score(q, kc.view(4, P, -1), vc.view(4, P, -1), **kwargs)


def test_fused_attention_rejects_float32(npu):
    torch_npu, _ = npu
    kc, vc = _caches()
    with pytest.raises(NPUContractError, match="float16/bfloat16"):
        torch_npu.npu_fused_infer_attention_score(
            torch.randn(5, 4, 16), kc.view(4, P, -1).float(), vc.view(4, P, -1).float(),
            **_fia_args(torch.tensor([[2, 0], [1, 3]], dtype=torch.int32), [130, 7], [3, 5]),
        )  # fmt: skip


def test_scatter_pa_kv_cache_writes_slots_and_needs_norm_mode(npu):
    torch_npu, _ = npu
    kc, vc = _caches()
    k = torch.randn(3, 2, 16).to(torch.bfloat16)
    slots = torch.tensor([5, 130, 511], dtype=torch.int32)
    with pytest.raises(NPUContractError, match="cache_mode='Norm'"):
        torch_npu.npu_scatter_pa_kv_cache(k, k, kc, vc, slots)  # default PA_NZ: NZ caches
    torch_npu.npu_scatter_pa_kv_cache(k, k, kc, vc, slots, cache_mode="Norm")
    assert torch.equal(kc[1, 2], k[1]) and torch.equal(vc[3, 127], k[2])
    with pytest.raises(NPUContractError, match="outside"):
        torch_npu.npu_scatter_pa_kv_cache(
            k, k, kc, vc, torch.tensor([0, 1, 4 * P], dtype=torch.int32), cache_mode="Norm"
        )
    with pytest.raises(NPUContractError, match="contiguous"):
        torch_npu.npu_scatter_pa_kv_cache(
            k.transpose(0, 1).contiguous().transpose(0, 1), k, kc, vc, slots, cache_mode="Norm"
        )


def _captured_attention(torch_npu, npu_ns, table, kv_lens, q_cum):
    """Capture x -> attention(x) * 2 with the attention in a task group (vllm-ascend's form)."""
    kc, vc = _caches()
    key, value = kc.view(4, P, -1), vc.view(4, P, -1)
    q = torch.zeros(4, 4, 16, dtype=torch.bfloat16)
    kwargs = _fia_args(table, kv_lens, q_cum)
    workspace = torch_npu._npu_fused_infer_attention_score_get_max_workspace(
        q, key, value, **kwargs
    )
    out = torch.empty_like(q)
    lse = torch.empty(1)
    graph = npu_ns.NPUGraph()
    event = npu_ns.ExternalEvent()
    stream = npu_ns.current_stream()
    with npu_ns.graph(graph):
        event.wait(stream)
        event.reset(stream)
        npu_ns.graph_task_group_begin(stream)
        torch_npu.npu_fused_infer_attention_score.out(
            q, key, value, workspace=workspace, out=[out, lse], **kwargs
        )
        handle = npu_ns.graph_task_group_end(stream)
        doubled = out * 2
    return graph, handle, event, dict(q=q, key=key, value=value, ws=workspace, out=out, lse=lse,
                                      doubled=doubled, kwargs=kwargs)  # fmt: skip


def _update(torch_npu, npu_ns, handle, event, s, **params):
    stream = npu_ns.Stream()
    with npu_ns.stream(stream):
        npu_ns.graph_task_update_begin(stream, handle)
        torch_npu.npu_fused_infer_attention_score.out(
            s["q"], s["key"], s["value"], workspace=s["ws"], out=[s["out"], s["lse"]],
            **{**s["kwargs"], **params},
        )  # fmt: skip
        npu_ns.graph_task_update_end(stream)
        event.record(stream)


def _eager(torch_npu, s, **params):
    out, _ = torch_npu.npu_fused_infer_attention_score(
        s["q"], s["key"], s["value"], **{**s["kwargs"], **params}
    )
    return out * 2


def test_graph_replays_updated_lengths_and_keeps_what_was_not_updated(npu):
    torch_npu, npu_ns = npu
    table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    graph, handle, event, s = _captured_attention(torch_npu, npu_ns, table, [130, 7], [2, 4])
    s["q"].copy_(torch.randn(4, 4, 16).to(torch.bfloat16))
    with pytest.raises(NPUContractError, match="nobody recorded"):
        graph.replay()  # no update since capture: on hardware the replay waits forever
    _update(torch_npu, npu_ns, handle, event, s, actual_seq_lengths_kv=[140, 9])
    graph.replay()
    assert torch.equal(s["doubled"], _eager(torch_npu, s, actual_seq_lengths_kv=[140, 9]))
    # A new block table passed as a new tensor must be given to the update: left out, the
    # replay reads the tensor captured with the task (stale pages).
    new_table = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)
    _update(torch_npu, npu_ns, handle, event, s, actual_seq_lengths_kv=[140, 9])
    graph.replay()
    stale = s["doubled"].clone()
    fresh = _eager(torch_npu, s, block_table=new_table, actual_seq_lengths_kv=[140, 9])
    assert not torch.equal(stale, fresh)
    _update(torch_npu, npu_ns, handle, event, s, block_table=new_table,
            actual_seq_lengths_kv=[140, 9])  # fmt: skip
    graph.replay()
    assert torch.equal(s["doubled"], fresh)
    # Rewriting the captured block table in place needs no update of that argument.
    table.copy_(new_table)
    _update(torch_npu, npu_ns, handle, event, s, actual_seq_lengths_kv=[140, 9])
    graph.replay()
    assert torch.equal(s["doubled"], fresh)


def test_graph_update_must_reissue_on_the_captured_tensors(npu):
    torch_npu, npu_ns = npu
    table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    graph, handle, event, s = _captured_attention(torch_npu, npu_ns, table, [130, 7], [2, 4])
    stream = npu_ns.Stream()
    npu_ns.graph_task_update_begin(stream, handle)
    with pytest.raises(NPUContractError, match="tensor given at capture"):
        torch_npu.npu_fused_infer_attention_score.out(
            s["q"].clone(), s["key"], s["value"], workspace=s["ws"], out=[s["out"], s["lse"]],
            **s["kwargs"],
        )  # fmt: skip


def test_graph_bakes_host_values_of_ordinary_ops(npu):
    _, npu_ns = npu
    x = torch.zeros(3)
    graph = npu_ns.NPUGraph()
    with npu_ns.graph(graph):
        lens = [1, 2, 3]
        y = x + torch.tensor(lens, dtype=torch.float32)  # a host list: baked at capture
    lens[0] = 100
    x.copy_(torch.ones(3))
    graph.replay()
    assert y.tolist() == [2.0, 3.0, 4.0]
    assert not npu_ns.is_current_stream_capturing()


def test_simulator_is_removed_after_the_block():
    with simulated():
        assert "torch_npu" in sys.modules and hasattr(torch, "npu")
    assert "torch_npu" not in sys.modules and not hasattr(torch, "npu")


def test_graph_runner_prepare_reissues_the_captured_attention_lengths(npu):
    """NPUGraphRunner + a captured NPUAttention DECODE forward: a replay without prepare
    raises; after prepare the replay equals the eager forward of the prepared lengths."""
    from polyspec.backend import ForwardBatch, ForwardMode, HostLengths
    from polyspec.backends.npu.attention import NPUAttention
    from polyspec.backends.npu.graph import NPUGraphRunner
    from polyspec.backends.npu.kv_pool import NPUKVPool
    from polyspec.runtime.graphs import padded

    pool = NPUKVPool(4 * P, 1, 2, 16, torch.bfloat16, "cpu")
    g = torch.Generator().manual_seed(3)
    pool.k_cache(0).copy_(torch.randn(4 * P, 2, 16, generator=g).to(torch.bfloat16))
    pool.v_cache(0).copy_(torch.randn(4 * P, 2, 16, generator=g).to(torch.bfloat16))
    attn = NPUAttention(pool, 4, 2, 16, 0.25, P)
    table = torch.arange(P, 4 * P, dtype=torch.int32).view(1, 3 * P)  # request row 0

    def batch(seq, host):
        return ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=torch.zeros(1, dtype=torch.long),
            positions=seq.long(), out_cache_loc=table[0].gather(0, seq.long()),
            req_pool_indices=torch.zeros(1, dtype=torch.int32), req_to_token=table,
            prefix_lens=seq, extend_lens=torch.ones(1, dtype=torch.int32), **host,
        )  # fmt: skip

    def lengths(params):
        return HostLengths(padded(params, "seq_lens", 1), [1])

    def captured(s):
        b = batch(s["seq"], {"host_lengths": lengths})
        meta = attn.build_static_metadata(b, 256)
        return attn.forward(s["q"], s["k"], s["v"], 0, meta)

    def inputs(seq):
        x = torch.randn(3, 1, 4, 16, generator=g).to(torch.bfloat16)
        return {"seq": torch.tensor([seq], dtype=torch.int32), "q": x[0], "k": x[1, :, :2],
                "v": x[2, :, :2]}  # fmt: skip

    runner = NPUGraphRunner(4)
    static = {n: torch.zeros_like(t) for n, t in inputs(0).items()}
    out = runner.capture("decode", captured, static)
    new = inputs(200)
    with pytest.raises(RuntimeError, match="without prepare"):
        runner.replay("decode", new)
    runner.prepare("decode", {"batch_size": 1, "max_prefix_len": 256, "seq_lens": [200]})
    runner.replay("decode", new)
    eager_b = batch(new["seq"], {"prefix_lens_cpu": [200], "extend_lens_cpu": [1]})
    want = attn.forward(new["q"], new["k"], new["v"], 0, attn.build_metadata(eager_b))
    assert torch.equal(out, want)
