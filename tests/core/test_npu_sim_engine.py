"""The real npu backend's fused path end to end, on the torch_npu simulator.

The conformance suite's lossless tests run float32 models, which the npu backend serves with
the portable attention (the fused operator takes float16 / bfloat16). These tests run bfloat16
models, so every forward mode goes through ``npu_fused_infer_attention_score`` and
``npu_scatter_pa_kv_cache``: prefill (TND causal), decode, the draft's lanes, chain
verification (TND causal) and tree verification (BSND, explicit mask), draft extend, and
with graphs on the captured rounds and prefills replayed as NPU graphs (the same layouts, each
attention call a graph task whose lengths ``prepare`` updates before every replay). The simulator
computes each operator row by row in float32, so a row's attention does not depend
on the batch; greedy speculative output must equal plain greedy output token for token.
"""

from __future__ import annotations

import random

import pytest

from polyspec.backends.npu.sim import simulated
from polyspec.config import SamplingParams, SpeculativeConfig
from polyspec.testing import builders


@pytest.fixture(scope="module")
def sim():
    # Reference kernels: Triton here is CUDA Triton (interpreted in CI), not triton-ascend;
    # the per-signature fallback is tested in test_npu_static.py.
    with pytest.MonkeyPatch.context() as mp, simulated() as s:
        mp.setenv("POLYSPEC_NPU_TRITON", "0")
        yield s


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("npu-tiny")
    target = builders.build_tiny_target(root / "target", seed=0)
    return {"target": target, "eagle3": builders.build_tiny_eagle3(root / "e3", target, seed=2)}


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 250) for _ in range(length)] for length in (5, 131, 40)[:n]]


def _generate(tiny, speculative=None, draft=None, prompts=3, graphs="off"):
    from polyspec.engine.llm import LLM

    llm = LLM(
        target=tiny["target"], draft=draft, speculative=speculative, backend="npu",
        dtype="bfloat16", page_size=128, max_batch_size=3, max_context=512, graphs=graphs,
    )  # fmt: skip
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=_prompts(prompts), sampling_params=params)
    return [o.token_ids for o in outs], llm


@pytest.fixture(scope="module")
def plain(sim, tiny):
    return _generate(tiny)[0]


@pytest.mark.parametrize(
    "topk, num_steps, num_draft_tokens, graphs",
    [(1, 3, 4, "off"), (2, 3, 6, "off"), (1, 3, 4, "on"), (2, 3, 6, "on")],
)
def test_bf16_spec_greedy_equals_plain_greedy_through_the_fused_operator(
    sim, tiny, plain, topk, num_steps, num_draft_tokens, graphs
):
    sim.op_calls.clear()
    replays, updates = sim.replays, sim.task_updates
    spec = SpeculativeConfig(
        algorithm="eagle3", topk=topk, num_steps=num_steps, num_draft_tokens=num_draft_tokens
    )
    outs, llm = _generate(tiny, spec, tiny["eagle3"], graphs=graphs)
    assert outs == plain
    # graphs on: the rounds replay NPU graphs, each after its attention tasks were updated
    assert (sim.replays > replays) == (graphs == "on")
    assert (sim.task_updates > updates) == (graphs == "on")
    assert llm.backend.device_type == "cpu"  # the simulator's device, not an NPU
    fia = "npu_fused_infer_attention_score"
    assert sim.op_calls[(fia, "TND", 3)] > 0  # prefill, decode, lanes, extend, chains
    assert (sim.op_calls[(fia, "BSND", 0)] > 0) == (topk > 1)  # tree verification only
