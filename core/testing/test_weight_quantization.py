"""Conformance: weight-only quantization (``capabilities.weight_quantization``,
``Backend.quantized_linear_fn``) against :func:`polyspec.kernels.quant.linear_int8`, and the
lossless property with a quantized draft head."""

from __future__ import annotations

import pytest
import torch

from polyspec.errors import ConfigError
from polyspec.kernels.quant import SCHEMES, linear_int8, quantize_int8
from polyspec.testing.plugin import require

# The callable sums in its own order and rounds once to x's dtype: a bound of the output
# dtype's rounding plus fp32 accumulation over K = 96 products.
_TOL = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.bfloat16: {"atol": 2e-2, "rtol": 1e-2},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
}


def test_listed_schemes_are_known(backend):
    unknown = set(backend.capabilities.weight_quantization) - set(SCHEMES)
    assert not unknown, f"weight_quantization lists unknown schemes {sorted(unknown)}"


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantized_linear_matches_reference(backend, scheme):
    require(scheme in backend.capabilities.weight_quantization, f"weight_quantization {scheme}")
    g = torch.Generator().manual_seed(20240611)
    dev = backend.device()
    served = []
    for name in backend.capabilities.dtypes:
        dtype = getattr(torch, name)
        w = torch.randn(37, 96, generator=g).to(dtype)
        bias = torch.randn(37, generator=g).to(dtype)
        x = torch.randn(5, 96, generator=g).to(dtype)
        w_dev = w.to(dev, copy=True)
        fn = backend.quantized_linear_fn(w_dev, scheme)
        if fn is None:
            continue  # the contract allows declining a weight (here: its dtype)
        served.append(name)
        q, scale = quantize_int8(w)
        want = linear_int8(x, q, scale, bias)
        for rows in (x, x[:1]):
            got = fn(rows.to(dev), bias.to(dev))
            assert got.dtype == dtype and got.shape == (rows.shape[0], 37)
            torch.testing.assert_close(got.cpu(), want[: rows.shape[0]], **_TOL[dtype])
        got = fn(x.to(dev), None)
        torch.testing.assert_close(got.cpu(), linear_int8(x, q, scale), **_TOL[dtype])
        assert torch.equal(w_dev.cpu(), w), "quantized_linear_fn modified the weight"
    assert served, (
        f"the backend lists weight_quantization {scheme!r} but quantized_linear_fn declined "
        f"weights of every model dtype it supports {backend.capabilities.dtypes}"
    )


def test_greedy_output_is_unchanged_by_a_quantized_head(backend, tiny_models):
    """Where the backend quantizes a bf16 head (its first scheme, asked for explicitly: "auto"
    may keep the head unquantized on this machine), speculative greedy output still equals
    plain."""
    from polyspec.config import SamplingParams, SpeculativeConfig
    from polyspec.engine.llm import LLM

    schemes = backend.capabilities.weight_quantization
    require(bool(schemes), "weight_quantization")
    require("bfloat16" in backend.capabilities.dtypes, "dtype bfloat16")
    require(backend.row_invariant(torch.bfloat16), "row-invariant bfloat16 forwards")
    kw = dict(backend=backend.name, dtype="bfloat16", max_context=128)
    spec = SpeculativeConfig(
        algorithm="eagle3", num_steps=3, topk=2, num_draft_tokens=6, draft_quantization=schemes[0]
    )
    try:
        llm = LLM(target=str(tiny_models["target"]), draft=str(tiny_models["eagle3"]),
                  speculative=spec, **kw)  # fmt: skip
    except ConfigError:  # the backend lists the scheme but declines this head's weights
        llm = None
    require(llm is not None and llm.draft_quantization != "none", "a quantized bfloat16 head")
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    ids = [[3, 1, 4, 1, 5], [9, 2, 6]]
    got = [o.token_ids for o in llm.generate(prompt_token_ids=ids, sampling_params=params)]
    plain = LLM(target=str(tiny_models["target"]), **kw)
    want = [o.token_ids for o in plain.generate(prompt_token_ids=ids, sampling_params=params)]
    assert got == want
