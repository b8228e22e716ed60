"""assert_greedy_equal tells a float32 near-tie from a wrong token: the tiny target of the
conformance suite has a real one (request 72 of the churn test's mix, after 5 tokens the
logits of tokens 147 and 22 differ by about 1e-4), and the next-best token there is 0.43
behind."""

from __future__ import annotations

import pytest

from polyspec.backends.cpu.backend import CPUBackend
from polyspec.model.loader import load_target
from polyspec.testing import builders
from polyspec.testing.forward import assert_greedy_equal, greedy_tie_margin
from polyspec.testing.test_engine_stress import _mixed_requests


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    backend = CPUBackend()
    path = builders.build_tiny_target(tmp_path_factory.mktemp("ties") / "t", seed=0)
    model = load_target(path, backend, dtype="float32")
    prompt = _mixed_requests(200)[0][72]
    return model, backend, prompt


def test_near_tie_is_told_from_a_wrong_token(case):
    model, backend, prompt = case
    head = [165, 22, 156, 22, 156]
    i, gap, scale = greedy_tie_margin(model, backend, prompt, head + [147], head + [22])
    assert i == 5 and gap < 1e-3 < scale
    assert assert_greedy_equal(model, backend, [prompt], [head + [147, 285]], [head + [22]]) == 1
    with pytest.raises(AssertionError, match="not a near-tie"):
        assert_greedy_equal(model, backend, [prompt], [head + [147]], [head + [61]])
    with pytest.raises(AssertionError, match="not a near-tie"):
        assert_greedy_equal(model, backend, [prompt], [[165, 22]], [[165, 23]])
    with pytest.raises(AssertionError, match="tokens, want"):
        assert_greedy_equal(model, backend, [prompt], [[165, 22]], [[165]])
    assert greedy_tie_margin(model, backend, prompt, head, head) is None
