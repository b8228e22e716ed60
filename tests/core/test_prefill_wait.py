"""prefill_wait_steps: requests joining a running batch are admitted together, at most the
given number of steps late, with the same greedy output as admitting each at once."""

from __future__ import annotations

import random

import pytest

from polyspec.config import EngineConfig, SamplingParams, SpeculativeConfig
from polyspec.engine.llm import LLM
from polyspec.errors import ConfigError
from polyspec.testing.builders import build_tiny_target


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_target(tmp_path_factory.mktemp("wait") / "t", seed=3)


def _run(target, wait: int, spec: bool):
    kw = dict(target=str(target), backend="cpu", dtype="float32", max_batch_size=4,
              max_context=128, prefill_wait_steps=wait)  # fmt: skip
    if spec:
        kw["draft"] = str(target)
        kw["speculative"] = SpeculativeConfig(algorithm="standalone", num_steps=2, topk=1)
    llm = LLM(**kw)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randint(3, 12))] for _ in range(14)]
    params = [SamplingParams(max_new_tokens=rng.randint(2, 20), ignore_eos=True) for _ in prompts]
    sched = llm.scheduler
    prefills, steps, admitted = [], [0], {}
    real_prefill, real_step = llm.worker.prefill, sched.step

    def prefill(rids, ends):
        prefills.append(list(rids))
        for rid in rids:
            admitted.setdefault(rid, steps[0])
        return real_prefill(rids, ends)

    def step():
        steps[0] += 1
        return real_step()

    llm.worker.prefill, sched.step = prefill, step
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    return [o.token_ids for o in outs], prefills, sched


@pytest.mark.parametrize("spec", [False, True])
def test_waiting_groups_prefills_and_keeps_outputs(tiny, spec):
    want, eager_prefills, _ = _run(tiny, 0, spec)
    got, grouped, sched = _run(tiny, 6, spec)
    assert got == want
    # the first wave fills the batch at once; joiners then come in groups, not one by one
    assert len(grouped[0]) == 4 and len(eager_prefills[0]) == 4
    assert len(grouped) < len(eager_prefills)
    assert max(len(g) for g in grouped[1:]) > 1
    assert sched.held_steps == 0  # the counter is reset once the queue is served


def test_waiting_is_bounded(tiny, monkeypatch):
    """No hold lasts longer than prefill_wait_steps, and nothing is held when every waiting
    request fits (the last joiners are admitted at once)."""
    from polyspec.engine.scheduler import Scheduler

    holds, run = [], [0]
    real = Scheduler._hold_admission

    def spy(self):
        hold = real(self)
        run[0] = run[0] + 1 if hold else 0
        holds.append(run[0])
        if hold:
            free = self.config.max_batch_size - len(self.decoding) - len(self.prefilling)
            assert free < len(self.waiting)
        return hold

    monkeypatch.setattr(Scheduler, "_hold_admission", spy)
    _run(tiny, 3, spec=True)
    assert max(holds) == 3


def test_prefill_wait_steps_is_checked():
    with pytest.raises(ConfigError, match="prefill_wait_steps"):
        EngineConfig(prefill_wait_steps=-1)
