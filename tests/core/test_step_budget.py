"""The engine step's token budget: the decode round takes its batch's verify width per request
(the tree that batch size runs, 1 for plain rounds), the prefill what is left, and never less
than a quarter of the budget."""

from __future__ import annotations

import random

import pytest

from polyspec.config import SamplingParams, SpeculativeConfig
from polyspec.engine.llm import LLM
from polyspec.testing.builders import build_tiny_target


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_target(tmp_path_factory.mktemp("budget") / "t", seed=3)


def _prefill_tokens(target, batch_trees: str, prompt_lens=(10, 30)):
    """Each prefill call's tokens and the budget the step had, over a run where requests keep
    joining a decoding batch; and the run's outputs."""
    llm = LLM(
        target=str(target), draft=str(target), backend="cpu", dtype="float32",
        max_batch_size=10, max_context=256, max_tokens_per_step=24, prefill_chunk_size=24,
        speculative=SpeculativeConfig(
            algorithm="standalone", num_steps=2, topk=1, num_draft_tokens=3,
            batch_trees=batch_trees,
        ),
    )  # fmt: skip
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randint(*prompt_lens))] for _ in range(24)]
    params = [SamplingParams(max_new_tokens=rng.randint(20, 40), ignore_eos=True) for _ in prompts]
    sched, worker = llm.scheduler, llm.worker
    calls = []
    real = worker.prefill

    def prefill(rids, ends):
        n = len(sched.decoding)
        width = worker.tree_for(n).num_draft_tokens if n else 0
        budget = max(24 - n * width, 6)
        done = [worker.states[r].prefilled for r in rids]
        calls.append((sum(e - d for e, d in zip(ends, done)), budget, n))
        return real(rids, ends)

    worker.prefill = prefill
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    return calls, [o.token_ids for o in outs]


def test_plain_rounds_leave_the_prefill_their_share(tiny):
    """From 4 requests the rounds are plain: 4 or more decoding requests take one token each,
    so the prefill gets 24 - n, where the widest tree's N = 3 would leave it 24 - 3n."""
    calls, outs = _prefill_tokens(tiny, "4:plain")
    assert all(tokens <= budget for tokens, budget, _ in calls)
    # the prefill did use what plain rounds leave, more than the speculative width would
    assert any(n >= 4 and tokens > max(24 - 3 * n, 6) for tokens, _, n in calls)
    _, spec_outs = _prefill_tokens(tiny, "")
    assert outs == spec_outs  # the schedule changes, not the greedy output


def test_a_full_decode_batch_leaves_the_prefill_a_quarter(tiny):
    """From 7 decoding requests of N = 3 the round's tokens leave the prefill fewer than 6 of
    24 (none from 8): it still gets 6 (a quarter), never a token or two a step."""
    calls, _ = _prefill_tokens(tiny, "", prompt_lens=(3, 12))
    assert all(tokens <= budget for tokens, budget, _ in calls)
    assert any(n >= 7 and tokens == 6 for tokens, _, n in calls)
