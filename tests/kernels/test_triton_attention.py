"""The cuda backend's Triton attentions (backends/cuda/attention.py: the paged kernel of
kernels/triton/attention.py, and the row-invariant kernels/triton/list_attention.py) against the float64 oracle of the conformance suite and the
cpu SDPA attention, in every mode, eager and captured metadata, under ``TRITON_INTERPRET=1``
(or compiled, with ``POLYSPEC_TRITON_DEVICE=cuda``)."""

from __future__ import annotations

import zlib

import pytest
import torch

from polyspec.backends.common import TensorKVPool
from polyspec.backends.cpu.backend import CPUBackend
from polyspec.backends.cuda.attention import RowInvariantAttention, TritonAttention
from polyspec.testing.test_attention import (
    SCENARIOS,
    Harness,
    SlotSource,
    build_batch,
    make_requests,
)


class _TritonAttentionBackend(CPUBackend):
    """The cpu backend with a Triton attention, on the Triton test device."""

    def __init__(self, device: str, attention: type = TritonAttention) -> None:
        super().__init__()
        self._dev = torch.device(device)
        self._attention = attention

    def device(self, rank: int = 0) -> torch.device:
        return self._dev

    def make_kv_pool(self, num_slots, num_layers, num_kv_heads, head_dim, dtype):
        return TensorKVPool(num_slots, num_layers, num_kv_heads, head_dim, dtype, self._dev)

    def make_attention(self, kv_pool, num_heads, num_kv_heads, head_dim, scale):
        return self._attention(kv_pool, num_heads, num_kv_heads, head_dim, scale)


ATTENTIONS = {"split": TritonAttention, "rowinv": RowInvariantAttention}


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("kind", list(ATTENTIONS))
def test_triton_attention_modes(triton_device, kind, scenario, page_size, static):
    mode, prefix, extend = SCENARIOS[scenario]
    gen = torch.Generator().manual_seed(zlib.crc32(f"triton/{scenario}/{page_size}".encode()))
    backend = _TritonAttentionBackend(triton_device, ATTENTIONS[kind])
    h = Harness([backend, CPUBackend()], torch.float32, 6, 2)
    reqs = make_requests([p + e for p, e in zip(prefix, extend)], SlotSource(page_size, gen), gen)
    h.fill(
        [s for b, r in enumerate(reqs.rows) for s in reqs.req_to_token[r, : prefix[b]].tolist()],
        gen,
    )
    batch = build_batch(mode, prefix, extend, reqs, gen, chain=scenario.endswith("chain"))
    if static:
        h.run_and_check_static(batch, gen)
    else:
        h.run_and_check(batch, gen)


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kind", list(ATTENTIONS))
def test_triton_attention_draft_decode_lanes(triton_device, kind, page_size, static):
    """S draft steps with K lanes (and, with pages, the copied partial page per lane)."""
    from polyspec.testing.test_attention import test_draft_decode_steps

    test_draft_decode_steps(
        _TritonAttentionBackend(triton_device, ATTENTIONS[kind]),
        CPUBackend(),
        page_size,
        "float32",
        static,
    )


@pytest.mark.parametrize("heads", [(4, 4), (4, 1), (9, 3)])
@pytest.mark.parametrize("kind", list(ATTENTIONS))
def test_triton_attention_head_layouts(triton_device, kind, heads):
    """MHA, MQA and SmolLM2's GQA 9/3, on a verify tree and on decode."""
    from polyspec.testing.test_attention import test_attention_head_layouts

    test_attention_head_layouts(
        _TritonAttentionBackend(triton_device, ATTENTIONS[kind]), CPUBackend(), heads
    )
