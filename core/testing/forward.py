"""Run a model on one request by hand (tests only; the runtime does this for real).

Builds single-request EXTEND / DECODE ForwardBatches over a backend's allocator, KV pool and
attention, so model tests need nothing from ``polyspec.runtime``.
"""

from __future__ import annotations

import torch

from polyspec.backend import AttentionMetadata, Backend, ForwardBatch, ForwardMode
from polyspec.model.llama import CausalLM


class SingleRequest:
    """One request's KV cache on ``backend`` for ``model`` (a CausalLM, or a DraftHead through
    :meth:`next_batch`): feed tokens, get logits."""

    def __init__(self, model: torch.nn.Module, backend: Backend, max_tokens: int = 256) -> None:
        c = model.config
        dtype = next(model.parameters()).dtype
        self.model, self.backend = model, backend
        self.device = backend.device()
        self.idx = backend.index_dtype
        # Slots come in whole pages of the backend's smallest page size (1 where supported).
        sizes = backend.capabilities.page_sizes
        self.page_size = ps = 1 if sizes is None or 1 in sizes else min(sizes)
        width = -(-max_tokens // ps) * ps
        self.max_tokens = max_tokens
        self.allocator = backend.make_allocator(width + ps, ps)
        # a tensor-parallel rank's model holds some of the heads
        heads, kv_heads = getattr(model, "local_heads", (c.num_heads, c.num_kv_heads))
        pool = backend.make_kv_pool(width + ps, c.num_layers, kv_heads, c.head_dim, dtype)
        self.attn = backend.make_attention(pool, heads, kv_heads, c.head_dim, c.attn_scale)
        self.req_to_token = torch.zeros(1, width, dtype=self.idx, device=self.device)
        self.seq_len = 0
        self.owned = 0  # positions [0, owned) are backed by slots (whole pages)

    def next_batch(self, input_ids: torch.Tensor) -> tuple[ForwardBatch, AttentionMetadata]:
        """Allocate slots for the next ``input_ids`` [T] (EXTEND, or DECODE for one token after a
        prefix) and build the batch and its attention metadata."""
        t = int(input_ids.shape[0])
        start = self.seq_len
        if start + t > self.max_tokens:
            raise RuntimeError("SingleRequest: out of KV slots; raise max_tokens")
        grow = -(-(start + t) // self.page_size) * self.page_size - self.owned
        if grow > 0:
            pages = self.allocator.alloc(grow)
            if pages is None:
                raise RuntimeError("SingleRequest: out of KV slots; raise max_tokens")
            self.req_to_token[0, self.owned : self.owned + grow] = pages
            self.owned += grow
        slots = self.req_to_token[0, start : start + t]
        mode = ForwardMode.DECODE if t == 1 and start > 0 else ForwardMode.EXTEND
        batch = ForwardBatch(
            mode=mode,
            input_ids=input_ids.to(self.device),
            positions=torch.arange(start, start + t, device=self.device),
            out_cache_loc=slots,
            req_pool_indices=torch.zeros(1, dtype=self.idx, device=self.device),
            req_to_token=self.req_to_token,
            prefix_lens=torch.tensor([start], dtype=self.idx, device=self.device),
            extend_lens=torch.tensor([t], dtype=self.idx, device=self.device),
            prefix_lens_cpu=[start],
            extend_lens_cpu=[t],
        )
        self.seq_len += t
        return batch, self.attn.build_metadata(batch)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64: the next T tokens of the request
        capture_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # ([T, H], [T, V] fp32, aux)
        """Run a CausalLM over the next ``input_ids``; returns (hidden, logits, aux)."""
        batch, metadata = self.next_batch(input_ids)
        hidden, aux = self.model(
            batch.input_ids, batch.positions, self.attn, metadata, capture_layers
        )
        return hidden, self.model.compute_logits(hidden), aux


def run_prefill(
    model: CausalLM,
    backend: Backend,
    input_ids: torch.Tensor,  # [T] int64
) -> tuple[torch.Tensor, torch.Tensor]:  # (hidden [T, H], logits [T, V] fp32)
    """Prefill one request from an empty cache; returns the final hidden states and logits."""
    with torch.inference_mode():
        hidden, logits, _ = SingleRequest(model, backend, int(input_ids.shape[0]) + 1).forward(
            input_ids
        )
    return hidden, logits


def greedy_tie_margin(
    model: CausalLM,
    backend: Backend,
    prompt_ids: list[int],
    want: list[int],
    got: list[int],
) -> tuple[int, float, float] | None:
    """Where two greedy outputs of ``model`` for one prompt first differ, and by how much.

    -> None when one output is a prefix of the other (they agree as far as both go); else
    ``(i, gap, scale)``: ``want[i] != got[i]``, ``gap`` is how far apart the target's logits
    for the two tokens are after ``prompt + want[:i]`` and ``scale`` the largest logit's
    magnitude there, from a single-request forward on ``backend``. Two correct greedy decoders that sum in
    different orders (a batched matmul against a one-row one, in float32) may pick different
    tokens only where this gap is within rounding; anything larger is a bug."""
    i = next((k for k, (a, b) in enumerate(zip(want, got)) if a != b), None)
    if i is None:
        return None
    ids = torch.tensor(prompt_ids + want[:i], device=backend.device())
    _, logits = run_prefill(model, backend, ids)
    last = logits[-1].double()
    return i, abs(float(last[want[i]] - last[got[i]])), float(last.abs().max())


def assert_greedy_equal(
    model: CausalLM,
    backend: Backend,
    prompts: list[list[int]],
    want: list[list[int]],
    got: list[list[int]],
    rel_tol: float = 1e-4,
) -> int:
    """Greedy outputs equal token for token, except from a near-tie on: where a pair first
    differs, the two tokens' float32 logits must lie within ``rel_tol`` of the largest logit's
    magnitude (a tie that rounding decides; the outputs may then differ after it), and the
    lengths must agree up to there. -> how many pairs diverged at a near-tie (callers may
    bound it: ties are rare by construction of the test models)."""
    ties = 0
    for k, (p, w, g) in enumerate(zip(prompts, want, got, strict=True)):
        div = greedy_tie_margin(model, backend, list(p), list(w), list(g))
        if div is None:
            assert len(w) == len(g), f"request {k}: {len(g)} tokens, want {len(w)}"
            continue
        i, gap, scale = div
        assert gap <= rel_tol * max(scale, 1.0), (
            f"request {k}: token {i} is {g[i]}, want {w[i]} (their logits differ by {gap:.3g}, "
            f"not a near-tie; outputs {g} vs {w})"
        )
        ties += 1
    return ties
