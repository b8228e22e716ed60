"""Target features for draft training: the EAGLE-3 aux hidden states, the final hidden state
and the target's greedy token, for every position of every training sequence.

Runs the target through the same backend contract as generation (EXTEND forwards over a
paged KV pool), so a head is trained on exactly the features it will see at inference.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from polyspec.backend import Backend, ForwardMode
from polyspec.runtime.batch_builder import BatchBuilder
from polyspec.runtime.kv_cache import KVCacheManager
from polyspec.runtime.model_runner import ModelRunner
from polyspec.runtime.req_pool import ReqToTokenPool


@dataclasses.dataclass
class SequenceFeatures:
    """One training sequence (prompt + answer) and the target's view of it."""

    ids: torch.Tensor  # [T] int64
    prompt_len: int
    aux: torch.Tensor  # [T, 3H] inputs of the three aux layers
    hidden: torch.Tensor  # [T, H] final normed hidden (the target's logits come from it)
    greedy: torch.Tensor  # [T] int64 the target's argmax after each position


@torch.inference_mode()
def extract_features(
    target,
    backend: Backend,
    sequences: list[tuple[list[int], int]],  # (token ids, prompt length)
    aux_layers: tuple[int, ...],
    token_budget: int = 4096,
    store_dtype: torch.dtype = torch.bfloat16,
    progress: Callable[[int], None] | None = None,
    store_device: torch.device | str = "cpu",
) -> list[SequenceFeatures]:
    """Features of each sequence, kept on ``store_device`` in ``store_dtype`` (on the
    accelerator when they fit: the training loop then never waits on host copies)."""
    max_len = max(len(s) for s, _ in sequences)
    budget = max(token_budget, max_len)
    max_reqs = max(1, budget // 16)
    dtype = next(target.parameters()).dtype
    req_pool = ReqToTokenPool(max_reqs, max_len, backend.device(), backend.index_dtype)
    kv = KVCacheManager(backend.make_allocator(budget + 1, 1), req_pool, backend.kernels)
    runner = ModelRunner(target, backend, budget + 1, dtype, tuple(aux_layers))
    builder = BatchBuilder(backend, req_pool)
    out: list[SequenceFeatures] = []
    i = 0
    while i < len(sequences):
        batch, used = [], 0
        while (
            i < len(sequences) and len(batch) < max_reqs and used + len(sequences[i][0]) <= budget
        ):
            batch.append(sequences[i])
            used += len(sequences[i][0])
            i += 1
        rows = [kv.add_request() for _ in batch]
        lens = [len(s) for s, _ in batch]
        kv.ensure(rows, lens)
        ids = builder.long([t for s, _ in batch for t in s])
        fb = builder.build(ForwardMode.EXTEND, rows, [0] * len(rows), lens, ids)
        hidden, aux = runner.forward_target(fb)
        greedy = torch.cat([target.compute_logits(h).argmax(-1) for h in hidden.split(1024)])
        for row in rows:
            kv.remove_request(row)
        pos = 0
        for (seq, plen), n in zip(batch, lens):
            sl = slice(pos, pos + n)
            out.append(
                SequenceFeatures(
                    ids=torch.tensor(seq, dtype=torch.int64, device=store_device),
                    prompt_len=plen,
                    aux=aux[sl].to(store_device, store_dtype),
                    hidden=hidden[sl].to(store_device, store_dtype),
                    greedy=greedy[sl].to(store_device),
                )
            )
            pos += n
        if progress:
            progress(len(batch))
    return out
