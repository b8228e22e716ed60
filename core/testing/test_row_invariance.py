"""Row-invariant forwards, for backends that claim them (``Backend.row_invariant(dtype)``):
a token's logits do not depend on the other tokens of its forward, bitwise, and therefore
greedy speculative output equals plain greedy output in that dtype, near-ties included.

Backends that make no claim (the default) skip these tests; the fp32 lossless grid
(``test_lossless.py``) still applies to them.
"""

from __future__ import annotations

import pytest
import torch

from polyspec.config import SamplingParams, SpeculativeConfig
from polyspec.testing.plugin import default_page_size

DTYPES = ["float32", "bfloat16"]


def _claimed(backend, dtype_name: str) -> None:
    if dtype_name not in backend.capabilities.dtypes:
        pytest.skip(f"backend lacks capability: dtype {dtype_name}")
    if not backend.row_invariant(getattr(torch, dtype_name)):
        pytest.skip(f"backend makes no row-invariance claim for {dtype_name}")


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_extend_rows_equal_decode_steps_bitwise(backend, tiny_models, dtype_name):
    """One 24-token EXTEND against 6 tokens then 18 one-token DECODE steps: equal logits."""
    from polyspec.model import load_target
    from polyspec.testing.forward import SingleRequest, run_prefill

    _claimed(backend, dtype_name)
    model = load_target(tiny_models["target"], backend, dtype_name)
    ids = torch.randint(3, 250, (24,), generator=torch.Generator().manual_seed(7))
    _, together = run_prefill(model, backend, ids)
    req = SingleRequest(model, backend, 32)
    with torch.inference_mode():
        _, first, _ = req.forward(ids[:6])
        steps = [req.forward(ids[i : i + 1])[1] for i in range(6, 24)]
    apart = torch.cat([first, *steps])
    assert torch.equal(apart.cpu(), together.cpu()), (
        f"{dtype_name}: rows differ between one EXTEND and DECODE steps at "
        f"{(apart.cpu() != together.cpu()).any(-1).nonzero().flatten().tolist()}"
    )


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("algorithm,topk,num_steps", [("self", 2, 3), ("eagle3", 2, 3)])
def test_spec_greedy_equals_plain_greedy_in_claimed_dtype(
    backend, backend_name, tiny_models, dtype_name, algorithm, topk, num_steps
):
    """Tree speculation (topk 2) against plain decoding, batch 5, in the claimed dtype."""
    from polyspec.engine.llm import LLM

    _claimed(backend, dtype_name)
    common = dict(
        target=tiny_models["target"], backend=backend_name, dtype=dtype_name,
        page_size=default_page_size(backend), max_batch_size=5, max_context=256,
    )  # fmt: skip
    prompts = [[(17 * i + 5 * j) % 240 + 3 for j in range(4 + 5 * i)] for i in range(5)]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    plain = [
        o.token_ids
        for o in LLM(**common).generate(prompt_token_ids=prompts, sampling_params=params)
    ]
    draft = tiny_models["target"] if algorithm == "self" else tiny_models[algorithm]
    spec = LLM(
        draft=draft,
        speculative=SpeculativeConfig(
            algorithm="standalone" if algorithm == "self" else algorithm,
            topk=topk,
            num_steps=num_steps,
        ),
        **common,
    )
    outs = spec.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in outs] == plain
