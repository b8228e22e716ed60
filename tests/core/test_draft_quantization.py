"""Draft-head int8 weights (``speculative.draft_quantization``): the scheme's reference, which
matrices are quantized, the settings' errors, and that the output stays the target's."""

from __future__ import annotations

import pytest
import torch

from polyspec.backend import BackendCapabilities
from polyspec.backends.cpu.backend import CPUBackend
from polyspec.config import EngineConfig, SamplingParams, SpeculativeConfig
from polyspec.errors import ConfigError
from polyspec.kernels.quant import linear_int8, quantize_int8
from polyspec.model.quantize import check_draft_quantization, quantize_draft


def test_quantize_int8_round_trips_within_half_a_step():
    w = torch.randn(33, 70, generator=torch.Generator().manual_seed(0))
    w[5] = 0.0  # an all-zero row keeps a usable scale
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == w.shape and scale.shape == (33,)
    assert q.abs().max() <= 127 and scale[5] == 1.0 and (q[5] == 0).all()
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7).all()
    # each row uses the whole range, so the step is as small as the row allows
    assert (q.abs().amax(1)[torch.arange(33) != 5] == 127).all()


def test_quantize_int8_refuses_what_it_cannot_quantize():
    with pytest.raises(ValueError, match="2-D floating-point"):
        quantize_int8(torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="inf or nan"):
        quantize_int8(torch.tensor([[1.0, float("inf")]]))


def test_linear_int8_is_the_dequantized_product():
    g = torch.Generator().manual_seed(1)
    w, x, b = torch.randn(9, 16, generator=g), torch.randn(3, 16, generator=g), torch.randn(9)
    q, scale = quantize_int8(w)
    expect = x @ (q.float() * scale[:, None]).T + b
    torch.testing.assert_close(linear_int8(x, q, scale, b), expect)


def test_settings_are_checked():
    with pytest.raises(
        ConfigError, match="draft_quantization.*must be one of 'auto', 'none', 'int8'"
    ):
        SpeculativeConfig(algorithm="eagle3", draft_quantization="int4")
    cpu = CPUBackend()
    check_draft_quantization("int8", "eagle3", cpu)  # listed by the cpu backend
    with pytest.raises(ConfigError, match="applies to EAGLE heads"):
        check_draft_quantization("int8", "standalone", cpu)

    class Bare(CPUBackend):
        name = "bare"

        def __init__(self) -> None:
            super().__init__()
            self.capabilities = BackendCapabilities()

    with pytest.raises(ConfigError, match="backend 'bare' does not support it"):
        check_draft_quantization("int8", "eagle3", Bare())
    check_draft_quantization("auto", "eagle3", Bare())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from polyspec.testing.builders import build_tiny_eagle3, build_tiny_target

    root = tmp_path_factory.mktemp("quant")
    target = build_tiny_target(root / "t", seed=0)
    return target, build_tiny_eagle3(root / "h", target, seed=2)


def _llm(tiny, dtype: str, setting: str, **kw):
    from polyspec.engine.llm import LLM

    target, head = tiny
    spec = SpeculativeConfig(
        algorithm="eagle3", num_steps=3, topk=2, num_draft_tokens=6, draft_quantization=setting
    )
    return LLM(target=str(target), draft=str(head), speculative=spec, backend="cpu", dtype=dtype,
               max_context=128, **kw)  # fmt: skip


def _kind(fn) -> str:  # the cpu backend's linears are bound C++ kernels (rowinv.cpp)
    return type(fn).__name__


def test_only_the_heads_own_matrices_are_quantized(tiny):
    auto = _llm(tiny, "bfloat16", "auto")
    # "auto": int8 where the kernels run on AVX-512 / AMX; an AVX2-only CPU keeps bf16
    want = "none" if auto.backend.row_invariant_kernels().isa() == "avx2" else "int8"
    assert auto.draft_quantization == want
    llm = _llm(tiny, "bfloat16", "int8")
    assert llm.draft_quantization == "int8"
    own = llm.draft.own_matrices()
    assert len({id(w) for w in own}) == 6  # fc, qkv, o, gate_up, down, the head's lm_head
    for w in own:
        assert _kind(w.polyspec_linear) == "BoundLinearW8"
    for w in llm.target.parameters():
        fn = getattr(w, "polyspec_linear", None)
        assert fn is None or _kind(fn) != "BoundLinearW8"
    assert quantize_draft(llm.draft, llm.backend, "none") == "none"
    for w in own:  # back to the backend's bf16 linear
        assert _kind(w.polyspec_linear) == "BoundLinear"
    assert quantize_draft(llm.draft, llm.backend, "int8") == "int8"
    assert all(_kind(w.polyspec_linear) == "BoundLinearW8" for w in own)


def test_fp32_heads_stay_unquantized_under_auto_and_int8_says_why(tiny):
    assert _llm(tiny, "float32", "auto").draft_quantization == "none"
    with pytest.raises(ConfigError, match="cannot quantize this head's float32 weights"):
        _llm(tiny, "float32", "int8")


@pytest.mark.parametrize("setting", ["int8", "none"])
def test_greedy_output_is_the_targets_with_int8_draft_weights(tiny, setting):
    """The quantized head proposes differently; the tokens are still plain greedy decoding's."""
    from polyspec.engine.llm import LLM

    ids = [[1, 5, 9, 2], [7, 7, 3]]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = LLM(target=str(tiny[0]), backend="cpu", dtype="bfloat16", max_context=128)
    want = [o.token_ids for o in plain.generate(prompt_token_ids=ids, sampling_params=params)]
    llm = _llm(tiny, "bfloat16", setting)
    assert llm.draft_quantization == setting
    got = [o.token_ids for o in llm.generate(prompt_token_ids=ids, sampling_params=params)]
    assert got == want


def test_the_key_reaches_the_config_from_a_mapping_and_the_cli_kinds():
    cfg = EngineConfig(speculative={"algorithm": "eagle3", "draft_quantization": "none"}, draft="x")
    assert cfg.speculative.draft_quantization == "none"
