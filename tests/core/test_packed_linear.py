"""The cpu backend's prepacked bf16 linear (Backend.linear_fn): same results as F.linear,
attached to every matrix the model multiplies with, and never to the embedding table."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from polyspec.backends.cpu.backend import CPUBackend, _onednn_bf16
from polyspec.config import SamplingParams, SpeculativeConfig
from polyspec.testing.builders import build_tiny_eagle3, build_tiny_target

pytestmark = pytest.mark.skipif(not _onednn_bf16(), reason="oneDNN bf16 not supported here")


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_equals_f_linear(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16() if with_bias else None
    x = torch.randn(rows, 40, generator=g).bfloat16()
    fn = CPUBackend().linear_fn(w)
    assert fn is not None
    out = fn(x, b)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 96)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=0, atol=0)
    assert CPUBackend().linear_fn(w.float()) is None  # fp32 keeps F.linear


def test_bf16_models_use_packed_weights_and_generate_the_same(tmp_path):
    from polyspec.engine.llm import LLM

    target = build_tiny_target(tmp_path / "t", seed=0)
    head = build_tiny_eagle3(tmp_path / "h", target, seed=2)
    spec = SpeculativeConfig(algorithm="eagle3", num_steps=3, topk=2, num_draft_tokens=6)
    llm = LLM(target=target, draft=head, speculative=spec, backend="cpu", dtype="bfloat16",
              max_context=128)  # fmt: skip
    layer = llm.target.layers[0]
    for w in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj,
              llm.target.lm_head_weight, llm.draft.fc):  # fmt: skip
        assert hasattr(w, "polyspec_linear")
    assert not hasattr(llm.target.embed_tokens, "polyspec_linear")
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42]]
    packed = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    for m in list(llm.target.modules()) + list(llm.draft.modules()):
        for p in m.parameters(recurse=False):
            if hasattr(p, "polyspec_linear"):
                del p.polyspec_linear
    plain = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert packed == plain
