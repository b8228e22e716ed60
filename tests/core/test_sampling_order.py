"""The runtime's sampling law: temperature, then top-k, then top-p (the documented order),
checked against the loop oracle for each request of a mixed batch."""

from __future__ import annotations

import torch

from polyspec.kernels.reference import reference_kernels
from polyspec.runtime.sampling import RequestSampler, SamplingBatch
from polyspec.testing import oracles

SETTINGS = [(0.6, 0, 0.8), (1.7, 0, 0.75), (1.4, 6, 0.7), (0.8, 4, 0.9), (0.0, 0, 1.0)]


def test_sampling_batch_probs_follow_the_documented_order():
    g = torch.Generator().manual_seed(11)
    rows, vocab = 3, 30  # rows per request: tree nodes share their request's settings
    samplers = [
        RequestSampler.create(t, k, p, seed=i, device=torch.device("cpu"))
        for i, (t, k, p) in enumerate(SETTINGS)
    ]
    logits = 2.5 * torch.randn(len(SETTINGS) * rows, vocab, generator=g)
    got = SamplingBatch(samplers, rows, torch.device("cpu")).probs(logits, reference_kernels())
    for i, row in enumerate(logits.double().tolist()):
        t, k, p = SETTINGS[i // rows]
        if t == 0.0:  # greedy: one-hot at the argmax
            want = [float(j == max(range(vocab), key=row.__getitem__)) for j in range(vocab)]
        else:
            want = oracles.transformed_probs(row, t, k, p)
        want = torch.tensor(want, dtype=torch.float64)
        torch.testing.assert_close(got[i].double(), want, atol=2e-6, rtol=1e-5)
        assert torch.equal(got[i] > 0, want > 0), f"row {i} ({t}, {k}, {p}) kept other tokens"
