"""Speculative sampling is lossless: sampled tokens follow the target's distribution.

The exact distribution of the tokens at generated positions 2..4 is computed by enumerating
every path the target can take under top-k filtering (k = 3, so at most 27 paths), with the
backend's own logits. Thousands of seeded speculative runs are then compared with it by a
chi-square test at significance 0.001 (bins with small expectation merged). A negative
control shows the same test rejects a wrong distribution at this sample size.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from polyspec.config import SamplingParams, SpeculativeConfig
from polyspec.testing.plugin import default_page_size, require

PROMPT = [17, 42, 99, 5, 61]
TOP_K = 3
TEMPERATURE = 1.3
POSITIONS = 4  # generated tokens 1..4; positions 2..4 are tested
NUM_SAMPLES = 1500


def _llm(backend, backend_name, tiny, algorithm=None, **spec):
    from polyspec.engine.llm import LLM

    draft = speculative = None
    if algorithm is not None:
        draft = tiny["target"] if algorithm == "self" else tiny[algorithm]
        algo = "standalone" if algorithm == "self" else algorithm
        speculative = SpeculativeConfig(algorithm=algo, **spec)
    return LLM(
        target=tiny["target"], draft=draft, speculative=speculative, backend=backend_name,
        dtype="float32", max_batch_size=64, max_context=64, page_size=default_page_size(backend),
    )  # fmt: skip


def _next_probs(llm, ids: list[int], temperature: float = TEMPERATURE) -> torch.Tensor:
    from polyspec.testing.forward import run_prefill

    _, logits = run_prefill(llm.target, llm.backend, torch.tensor(ids, device=llm.backend.device()))
    p = torch.softmax(logits[-1].double() / temperature, -1)
    top = p.topk(TOP_K)
    out = torch.zeros_like(p)
    out[top.indices] = top.values / top.values.sum()
    return out.cpu()


def exact_marginals(llm, temperature: float = TEMPERATURE) -> list[dict[int, float]]:
    """P(token at generated position i = t) for i = 0..POSITIONS-1, by enumerating paths."""
    marg: list[dict[int, float]] = [Counter() for _ in range(POSITIONS)]
    frontier = [([], 1.0)]
    for i in range(POSITIONS):
        nxt = []
        for path, pr in frontier:
            p = _next_probs(llm, PROMPT + path, temperature)
            for t in p.nonzero().flatten().tolist():
                marg[i][t] += pr * float(p[t])
                nxt.append((path + [t], pr * float(p[t])))
        frontier = nxt
    return marg


def chi_square_rejects(counts: Counter, probs: dict[int, float], n: int) -> tuple[bool, str]:
    """Chi-square goodness of fit at alpha = 0.001 (Wilson-Hilferty quantile), merging bins
    whose expected count is below 5 into one."""
    bins, merged_obs, merged_exp = [], 0.0, 0.0
    for t, p in probs.items():
        if p * n >= 5:
            bins.append((counts.get(t, 0), p * n))
        else:
            merged_obs += counts.get(t, 0)
            merged_exp += p * n
    outside = sum(c for t, c in counts.items() if t not in probs)
    merged_obs += outside
    if merged_exp > 0 or outside:
        bins.append((merged_obs, max(merged_exp, 1e-9)))
    stat = sum((o - e) ** 2 / e for o, e in bins)
    df = max(len(bins) - 1, 1)
    z = 3.0902  # one-sided 0.999 normal quantile
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat > crit, f"chi2 = {stat:.1f}, critical value {crit:.1f} (df {df}, n {n})"


def _sample_counts(llm, n: int, seed0: int = 0) -> list[Counter]:
    params = [
        SamplingParams(max_new_tokens=POSITIONS, temperature=TEMPERATURE, top_k=TOP_K,
                       seed=seed0 + i, ignore_eos=True)
        for i in range(n)
    ]  # fmt: skip
    outs = llm.generate(prompt_token_ids=[PROMPT] * n, sampling_params=params)
    counts = [Counter() for _ in range(POSITIONS)]
    for o in outs:
        assert len(o.token_ids) == POSITIONS
        for i, t in enumerate(o.token_ids):
            counts[i][t] += 1
    return counts


@pytest.fixture(scope="module")
def exact(backend, backend_name, tiny_models):
    return exact_marginals(_llm(backend, backend_name, tiny_models))


@pytest.mark.parametrize(
    "algorithm,topk,num_steps,dynamic_depth,batch_trees",
    [
        ("self", 1, 3, 0.0, ""),
        ("eagle3", 2, 3, 0.0, ""),
        ("self", 2, 3, 0.0, ""),
        ("self", 2, 3, 0.6, ""),
        ("self", 2, 3, 0.0, "24:2-1-3,48:4-3-9"),
        ("eagle3", 2, 3, 0.0, "48:plain"),
    ],
)
def test_speculative_sampling_matches_target(
    backend,
    backend_name,
    tiny_models,
    exact,
    algorithm,
    topk,
    num_steps,
    dynamic_depth,
    batch_trees,
):
    """Also with dynamic depth: rounds that stop drafting early verify probability-0 filler
    nodes (repeated tokens), which must not bias the sample. And with batch trees: the
    batches of 64 sample through a wider, deeper tree than the last, smaller batch, or
    (``48:plain``) through plain rounds, each token a draw from the target's distribution."""
    require(topk == 1 or backend.capabilities.tree_attention, "tree_attention (topk > 1)")
    llm = _llm(
        backend, backend_name, tiny_models, algorithm, topk=topk, num_steps=num_steps,
        dynamic_depth=dynamic_depth, batch_trees=batch_trees,
    )  # fmt: skip
    counts = _sample_counts(llm, NUM_SAMPLES)
    if dynamic_depth > 0:
        levels = llm.worker.drafted_levels
        assert sum(levels[1:num_steps]) > 0, f"no round stopped drafting early: {levels}"
    if batch_trees:
        used = [label for label, n in llm.worker.rounds_by_tree.items() if n]
        assert len(used) >= 2, f"rounds by tree: {llm.worker.rounds_by_tree}"
    for i in range(1, POSITIONS):
        rejected, msg = chi_square_rejects(counts[i], exact[i], NUM_SAMPLES)
        assert not rejected, f"generated position {i + 1}: {msg}"


def test_chi_square_detects_a_wrong_distribution(backend, backend_name, tiny_models, exact):
    """Negative control: the exact marginals at another temperature are rejected."""
    wrong = exact_marginals(_llm(backend, backend_name, tiny_models), temperature=0.6)
    n = NUM_SAMPLES
    for i in range(1, POSITIONS):
        expected_counts = Counter({t: round(p * n) for t, p in wrong[i].items()})
        rejected, msg = chi_square_rejects(expected_counts, exact[i], n)
        assert rejected, f"position {i + 1}: a wrong distribution was accepted ({msg})"


def test_sampling_determinism_and_greedy_limits(backend, backend_name, tiny_models):
    spec = _llm(backend, backend_name, tiny_models, "self", topk=2, num_steps=3)
    plain = _llm(backend, backend_name, tiny_models)
    prompts = [PROMPT, PROMPT[:3], [7, 8, 9, 10, 11, 12, 13]]
    greedy = [o.token_ids for o in plain.generate(
        prompt_token_ids=prompts, sampling_params=SamplingParams(max_new_tokens=10, ignore_eos=True))]  # fmt: skip

    def run(llm, **kw):
        p = SamplingParams(max_new_tokens=10, ignore_eos=True, **kw)
        return [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=p)]

    # same seed, same output (and independent of what else is in the batch)
    a = run(spec, temperature=1.0, seed=5)
    assert a == run(spec, temperature=1.0, seed=5)
    alone = spec.generate(prompt_token_ids=[prompts[1]], sampling_params=SamplingParams(
        max_new_tokens=10, ignore_eos=True, temperature=1.0, seed=5))[0].token_ids  # fmt: skip
    assert alone == a[1]
    # top_k = 1 and a vanishing temperature are greedy
    assert run(spec, temperature=1.0, top_k=1, seed=3) == greedy
    assert run(spec, temperature=1e-5, seed=3) == greedy
    # greedy and sampled requests mixed in one batch: the greedy ones stay greedy
    params = [SamplingParams(max_new_tokens=10, ignore_eos=True),
              SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=1.0, seed=1),
              SamplingParams(max_new_tokens=10, ignore_eos=True)]  # fmt: skip
    mixed = [o.token_ids for o in spec.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert mixed[0] == greedy[0] and mixed[2] == greedy[2]


def _transformed_marginals(llm, temperature: float, top_k: int, top_p: float, positions: int):
    """P(token at generated position i = t) under the documented law (temperature, then
    top-k, then top-p; :func:`polyspec.testing.oracles.transformed_probs`), by enumerating
    every path; and the law of the first token under the mask taken before the temperature
    (a classic bug), to show that the case tells the two apart."""
    from polyspec.testing import oracles
    from polyspec.testing.forward import run_prefill

    marg: list[Counter] = [Counter() for _ in range(positions)]
    wrong: Counter = Counter()
    frontier = [([], 1.0)]
    dev = llm.backend.device()
    for i in range(positions):
        nxt = []
        for path, pr in frontier:
            ids = torch.tensor(PROMPT + path, device=dev)
            row = run_prefill(llm.target, llm.backend, ids)[1][-1].double().cpu().tolist()
            law = oracles.transformed_probs(row, temperature, top_k, top_p)
            for t in range(len(row)):
                if law[t] > 0:
                    marg[i][t] += pr * law[t]
                    nxt.append((path + [t], pr * law[t]))
            if i == 0:
                mask = oracles.transformed_probs(row, 1.0, top_k, top_p)
                plain = oracles.transformed_probs(row, temperature, 0, 1.0)
                kept = [x if m > 0 else 0.0 for x, m in zip(plain, mask)]
                wrong.update({t: x / sum(kept) for t, x in enumerate(kept) if x > 0})
        frontier = nxt
    return marg, wrong


@pytest.mark.parametrize(
    "temperature,top_k,top_p,algorithm",
    [(0.6, 0, 0.8, "self"), (1.5, 8, 0.7, "eagle3")],
)
def test_sampling_transforms_follow_the_documented_order(
    backend, backend_name, tiny_models, temperature, top_k, top_p, algorithm
):
    """Temperature with top-p, and top-k with top-p, through the engine (the first token from
    the prefill's sampler, the next ones from speculative rounds): the tokens at generated
    positions 1 and 2 follow the law of temperature, then top-k, then top-p, computed exactly
    by enumeration; the cases are chosen so that the wrong order gives another law."""
    require(backend.capabilities.tree_attention, "tree_attention (topk > 1)")
    positions, n = 2, 256
    llm = _llm(backend, backend_name, tiny_models, algorithm, topk=2, num_steps=2)
    exact, wrong = _transformed_marginals(llm, temperature, top_k, top_p, positions)
    apart = sum(abs(exact[0].get(t, 0.0) - wrong.get(t, 0.0)) for t in set(exact[0]) | set(wrong))
    assert apart > 0.1, f"case too weak: the wrong order changes the law by only {apart:.3f}"
    params = [
        SamplingParams(max_new_tokens=positions, temperature=temperature, top_k=top_k,
                       top_p=top_p, seed=100 + i, ignore_eos=True)
        for i in range(n)
    ]  # fmt: skip
    outs = llm.generate(prompt_token_ids=[PROMPT] * n, sampling_params=params)
    counts = [Counter() for _ in range(positions)]
    for o in outs:
        assert len(o.token_ids) == positions
        for i, t in enumerate(o.token_ids):
            counts[i][t] += 1
    for i in range(positions):
        rejected, msg = chi_square_rejects(counts[i], exact[i], n)
        assert not rejected, f"generated position {i + 1}: {msg}"
