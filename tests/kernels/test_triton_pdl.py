"""Programmatic dependent launch (kernels/triton/pdl.py): the forward's kernels launched with it
compute bitwise what they compute without it, in a chain where each kernel reads what the one
before wrote, eagerly and replayed from a CUDA graph. A kernel that read or wrote before its
wait would race with the kernel before it, and a chain of a few hundred launches with new
inputs at every replay shows it. Runs compiled on a GPU of compute capability 9.0 or later
(``POLYSPEC_TRITON_DEVICE=cuda``, ci/device_cuda.sh); the interpreter has no PDL."""

from __future__ import annotations

import os

import pytest
import torch

from polyspec.kernels.triton.activation import silu_and_mul
from polyspec.kernels.triton.argmax import argmax
from polyspec.kernels.triton.cache import store_kv
from polyspec.kernels.triton.linear import row_invariant_linear
from polyspec.kernels.triton.list_attention import list_attention
from polyspec.kernels.triton.norm import fused_add_rms_norm, rms_norm
from polyspec.kernels.triton.rope import rotary_embedding

pytestmark = pytest.mark.skipif(
    os.environ.get("POLYSPEC_TRITON_DEVICE") != "cuda"
    or not torch.cuda.is_available()
    or torch.cuda.get_device_capability() < (9, 0),
    reason="programmatic dependent launch needs a GPU of compute capability 9.0 or later "
    "(POLYSPEC_TRITON_DEVICE=cuda)",
)

H, HEADS, KV_HEADS, D, INTER, VOCAB, LAYERS = 256, 4, 2, 64, 512, 3000, 12


def _weights(gen: torch.Generator) -> list[dict[str, torch.Tensor]]:
    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) / shape[-1] ** 0.5).to("cuda", torch.bfloat16)

    qkv = (HEADS + 2 * KV_HEADS) * D
    return [
        {
            "norm1": w(H) + 1,
            "norm2": w(H) + 1,
            "qkv": w(qkv, H),
            "o": w(H, HEADS * D),
            "gate_up": w(2 * INTER, H),
            "down": w(H, INTER),
        }
        for _ in range(LAYERS)
    ]


def _forward(
    x: torch.Tensor,  # [T, H] bf16
    positions: torch.Tensor,  # [T]
    layers: list[dict[str, torch.Tensor]],
    lm_head: torch.Tensor,  # [V, H]
    cos_sin: torch.Tensor,  # [max_pos, D] fp32
    caches: tuple[torch.Tensor, torch.Tensor],  # [LAYERS * slots, Hkv, D] each
    loc: torch.Tensor,  # [T] slots of this forward's keys in layer 0
    lists: torch.Tensor,  # [T, L] keys of each token in layer 0
    lens: torch.Tensor,  # [T]
    slots: int,
    pdl: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, V] fp32 logits, [T] greedy tokens)
    """A decoder forward out of the PDL kernels, in the order a model runs them."""
    t = x.shape[0]
    residual = x
    h = rms_norm(x, layers[0]["norm1"], 1e-6, pdl=pdl)
    for i, layer in enumerate(layers):
        if i:
            h, residual = fused_add_rms_norm(x, residual, layer["norm1"], 1e-6, pdl=pdl)
        qkv = row_invariant_linear(h, layer["qkv"], pdl=pdl).view(t, -1, D)
        q, k, v = qkv[:, :HEADS], qkv[:, HEADS : HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS :]
        q, k = rotary_embedding(positions, q, k, cos_sin, True, pdl=pdl)
        k_cache, v_cache = caches
        store_kv(k_cache, v_cache, loc + i * slots, k, v, pdl=pdl)
        o = list_attention(q, k_cache, v_cache, lists + i * slots, lens, 0.125, pdl=pdl)
        x = row_invariant_linear(o.reshape(t, -1), layer["o"], pdl=pdl)
        h, residual = fused_add_rms_norm(x, residual, layer["norm2"], 1e-6, pdl=pdl)
        gu = row_invariant_linear(h, layer["gate_up"], pdl=pdl)
        x = row_invariant_linear(silu_and_mul(gu, pdl=pdl), layer["down"], pdl=pdl)
    out, _ = fused_add_rms_norm(x, residual, layers[-1]["norm1"], 1e-6, pdl=pdl)
    logits = row_invariant_linear(out, lm_head, pdl=pdl).float()
    return logits, argmax(logits, pdl=pdl)


def _equal(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_pdl_forward_equals_the_forward_without_it_eager_and_in_a_graph():
    gen = torch.Generator().manual_seed(0)
    layers = _weights(gen)
    lm_head = (torch.randn(VOCAB, H, generator=gen) / H**0.5).to("cuda", torch.bfloat16)
    t, slots, max_pos = 4, 64, 128
    cos_sin = torch.randn(max_pos, D, generator=gen).to("cuda")
    positions = torch.arange(t, device="cuda") + 10
    loc = torch.arange(t, device="cuda") + 10
    # token j attends to slots 0..10+j of its layer: a prefix written below, then its own key
    lists = torch.arange(11 + t, device="cuda").repeat(t, 1)
    lens = torch.arange(t, device="cuda", dtype=torch.int32) + 11

    def run(x: torch.Tensor, pdl: bool, caches: tuple[torch.Tensor, torch.Tensor]):
        return _forward(
            x, positions, layers, lm_head, cos_sin, caches, loc, lists, lens, slots, pdl
        )

    def fresh_caches() -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1)
        shape = (LAYERS * slots, KV_HEADS, D)
        return tuple(torch.randn(*shape, generator=g).to("cuda", torch.bfloat16) for _ in "kv")

    inputs = [torch.randn(t, H, generator=gen).to("cuda", torch.bfloat16) for _ in range(30)]
    plain_caches, pdl_caches = fresh_caches(), fresh_caches()
    expected = [run(x, False, plain_caches) for x in inputs]
    eager = [run(x, True, pdl_caches) for x in inputs]
    assert all(_equal(a, b) for a, b in zip(expected, eager))
    assert all(torch.equal(a, b) for a, b in zip(plain_caches, pdl_caches))

    graph_caches = fresh_caches()
    static_x = inputs[0].clone()
    run(static_x, True, graph_caches)  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = run(static_x, True, graph_caches)
    torch.cuda.current_stream().wait_stream(stream)
    graph_caches[0].copy_(fresh_caches()[0])
    graph_caches[1].copy_(fresh_caches()[1])
    for x, want in zip(inputs, expected):
        static_x.copy_(x)
        graph.replay()
        assert _equal(static_out, want)
    assert all(torch.equal(a, b) for a, b in zip(plain_caches, graph_caches))
