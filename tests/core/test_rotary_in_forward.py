"""The model's side of ``AttentionBackend.rotary_in_forward``: an attention that rotates q and
k itself gets the positions and the cos/sin table the model would have used, in every forward
of a speculative engine (target and EAGLE head, prefill, draft lanes, verify, draft extend):
greedy output is token for token the cpu backend's. The cuda backend's attention that does
this in one kernel is checked against its two-kernel path in tests/kernels."""

from __future__ import annotations

import torch

from polyspec import LLM, SamplingParams, SpeculativeConfig
from polyspec.backend import AttentionBackend, Rotary
from polyspec.backends.cpu.backend import CPUBackend
from polyspec.testing.builders import build_bigram_models


class _RotatingAttention(AttentionBackend):
    """The cpu backend's attention, taking q and k before rotary embedding."""

    rotary_in_forward = True

    def __init__(self, inner: AttentionBackend, kernels) -> None:
        self.inner, self.kernels, self.calls = inner, kernels, 0

    def build_metadata(self, batch):
        return self.inner.build_metadata(batch)

    def build_static_metadata(self, batch, max_prefix_len):
        return self.inner.build_static_metadata(batch, max_prefix_len)

    def forward(self, q, k, v, layer, metadata, rotary: Rotary | None = None):
        assert rotary is not None and rotary.positions.shape[0] == q.shape[0]
        self.calls += 1
        q, k = self.kernels.rotary_embedding(
            rotary.positions, q, k, rotary.cos_sin_cache, rotary.is_neox
        )
        return self.inner.forward(q, k, v, layer, metadata)


class _RotatingBackend(CPUBackend):
    def __init__(self) -> None:
        super().__init__()
        self.attentions: list[_RotatingAttention] = []

    def make_attention(self, *args):
        attn = _RotatingAttention(super().make_attention(*args), self.kernels)
        self.attentions.append(attn)
        return attn


def _generate(backend, graphs: str) -> list[list[int]]:
    target, head = build_bigram_models(backend, layer_scale=1.0)
    spec = SpeculativeConfig("eagle", num_steps=3, topk=2, num_draft_tokens=6)
    llm = LLM.from_modules(
        target, head, spec, backend=backend, graphs=graphs, max_batch_size=4, max_context=256
    )
    prompts = [[3 + (5 * i + j) % 60 for j in range(9 + 4 * i)] for i in range(3)]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    return [o.token_ids for o in outs]


def test_attention_that_rotates_gets_the_models_rotary():
    torch.manual_seed(0)
    for graphs in ("off", "on"):
        rotating = _RotatingBackend()
        assert _generate(rotating, graphs) == _generate(CPUBackend(), graphs), graphs
        assert len(rotating.attentions) == 2 and all(a.calls > 0 for a in rotating.attentions)
