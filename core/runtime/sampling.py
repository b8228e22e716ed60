"""Per-request sampling state and the logits -> probabilities -> token path.

Randomness comes from one ``torch.Generator`` per request (seeded from ``SamplingParams.seed``,
or from the engine seed and the request id), so a request's output depends only on its own
seed, not on what else shares its batch. All draws stay on the device: no host syncs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from polyspec.backend import KernelSet


@dataclasses.dataclass
class RequestSampler:
    """Sampling settings and random stream of one request."""

    temperature: float
    top_k: int
    top_p: float
    generator: torch.Generator | None  # None for greedy requests

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    @classmethod
    def create(
        cls, temperature: float, top_k: int, top_p: float, seed: int, device: torch.device
    ) -> RequestSampler:
        greedy = temperature <= 0.0 or top_k == 1
        gen = None
        if not greedy:
            gen = torch.Generator(device=device)
            gen.manual_seed(seed)
        return cls(temperature, top_k, top_p, gen)

    def uniform(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        return torch.rand(shape, generator=self.generator, device=device)

    def exponential(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        return torch.empty(shape, device=device).exponential_(generator=self.generator)


def target_probs(
    logits: torch.Tensor,  # [n, V]
    params: torch.Tensor,  # [n, 4] fp32: temperature, top_k, top_p, 1 if sampled
    kernels: KernelSet,
) -> torch.Tensor:  # [n, V] fp32
    """Target distribution after temperature, top-k and top-p, from device tensors only. Rows
    not sampled (greedy requests, a graph's zeroed padding rows) become one-hot at the argmax,
    which makes sampling verification reproduce greedy verification exactly."""
    sampled = params[:, 3] > 0
    temperature = torch.where(sampled, params[:, 0], 1.0)
    top_p = torch.where(sampled, params[:, 2], 1.0)
    logits = logits.float()
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    probs = kernels.top_k_top_p_renorm(probs, params[:, 1].long(), top_p)
    onehot = torch.zeros_like(probs).scatter_(1, kernels.argmax(logits)[:, None], 1.0)
    return torch.where(sampled[:, None], probs, onehot)


class SamplingBatch:
    """Tensors of the sampling settings of a batch, each request repeated ``rows_per_request``
    times (N tree nodes per request when verifying)."""

    def __init__(
        self,
        samplers: Sequence[RequestSampler],
        rows_per_request: int,
        device: torch.device,
        upload: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        """``upload``: a 1-D CPU tensor -> the same on ``device`` without waiting for the
        work queued there (``Backend.host_tensor``); None: ``Tensor.to``, which may wait."""
        self.samplers = list(samplers)
        self.rows = rows_per_request
        self.device = device
        self.upload = upload
        self.all_greedy = all(s.greedy for s in samplers)

    def params(self) -> torch.Tensor:  # [bs, 4] fp32
        """Each request's (temperature, top_k, top_p, 1 if sampled else 0), for
        :func:`target_probs` (one row per request, not repeated)."""
        values = [
            (s.temperature, float(s.top_k), s.top_p, 0.0 if s.greedy else 1.0)
            for s in self.samplers
        ]
        host = torch.tensor(values, dtype=torch.float32)
        if self.upload is None:
            return host.to(self.device)
        return self.upload(host.reshape(-1)).view(-1, 4)

    def probs(self, logits: torch.Tensor, kernels: KernelSet) -> torch.Tensor:
        """Target distribution after temperature, top-k and top-p: [n, V] fp32. Greedy rows
        become one-hot at the argmax, which makes sampling verification reproduce greedy
        verification exactly."""
        params = self.params().repeat_interleave(self.rows, dim=0)
        return target_probs(logits, params, kernels)

    def exponential(self, vocab: int) -> torch.Tensor:
        """Exp(1) noise [bs * rows, V], each request's rows from its own stream."""
        noise = [
            s.exponential((self.rows, vocab), self.device)
            if not s.greedy
            else torch.ones(self.rows, vocab, device=self.device)
            for s in self.samplers
        ]
        return torch.cat(noise)

    def uniform(self, per_request: int) -> torch.Tensor:
        """Uniform [bs, per_request] from each request's own stream (zeros for greedy ones)."""
        rows = [
            s.uniform((per_request,), self.device)
            if not s.greedy
            else torch.zeros(per_request, device=self.device)
            for s in self.samplers
        ]
        return torch.stack(rows)

    def sample(self, logits: torch.Tensor, kernels: KernelSet) -> torch.Tensor:
        """One token per row of ``logits`` [bs * rows, V] -> [bs * rows] int64."""
        if self.all_greedy:
            return kernels.argmax(logits)
        probs = self.probs(logits, kernels)
        return kernels.sample(probs, self.exponential(probs.shape[-1]))
