"""The cpu backend's prepacked linears (Backend.linear_fn): bf16 packed for oneDNN where the
CPU runs bf16 natively (same results as F.linear), fp32 packed otherwise (fp32 weights, and bf16
inputs of two rows or more on other CPUs); attached to every matrix the model multiplies with,
and never to the embedding table."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from polyspec.backends.cpu.backend import CPUBackend, _onednn_bf16
from polyspec.config import SamplingParams, SpeculativeConfig
from polyspec.testing.builders import build_tiny_eagle3, build_tiny_target

needs_onednn_bf16 = pytest.mark.skipif(not _onednn_bf16(), reason="oneDNN bf16 not supported")
needs_mkldnn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="oneDNN not built into this torch"
)


@needs_onednn_bf16
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


@needs_mkldnn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp32_packed_linear_matches_f_linear_and_is_row_independent(dtype, with_bias):
    g = torch.Generator().manual_seed(7)
    w = torch.randn(96, 40, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype) if with_bias else None
    x = torch.randn(17, 40, generator=g).to(dtype)
    fn = CPUBackend().linear_fn(w)
    assert fn is not None
    full = fn(x, b)
    assert full.dtype == dtype and full.shape == (17, 96)
    # fp32 arithmetic, then one rounding: within one bf16 ulp of F.linear's result
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(full.float(), ref, **tol)
    for rows in (2, 6, 16):  # a row's result does not depend on the rows beside it
        assert torch.equal(fn(x[:rows], b), full[:rows])
    if dtype == torch.float32:
        assert torch.equal(fn(x[:1], b), full[:1])
    elif not _onednn_bf16():  # single bf16 rows stay on F.linear, the faster kernel there
        assert torch.equal(fn(x[:1], b), F.linear(x[:1], w, b))


@needs_onednn_bf16
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
