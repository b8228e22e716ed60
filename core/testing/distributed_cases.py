"""What each rank runs in the distributed conformance tests (:mod:`.test_distributed`).

Every function takes ``(tp, backend, ...)``: this rank's group and its backend, bound to its
local rank. They raise ``AssertionError`` on a wrong result, which fails the test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from polyspec.parallel.group import TPGroup


def collectives(tp: TPGroup, backend: Any) -> None:
    """The declared distributed backend sums, gathers and broadcasts correctly on the
    backend's device, in every model dtype it supports."""
    w, r, dev = tp.world_size, tp.rank, backend.device()
    for name in backend.capabilities.dtypes:
        dtype = getattr(torch, name)
        x = torch.full((3, 5), float(r + 1), dtype=dtype, device=dev)
        tp.all_reduce(x)
        want = float(w * (w + 1) // 2)
        assert torch.equal(x, torch.full_like(x, want)), f"all_reduce {name}: {x}"
        part = torch.arange(4, dtype=dtype, device=dev).reshape(2, 2) + 10 * r
        got = tp.all_gather_last(part)
        expect = torch.cat(
            [torch.arange(4, dtype=dtype, device=dev).reshape(2, 2) + 10 * k for k in range(w)],
            dim=-1,
        )
        assert torch.equal(got, expect), f"all_gather {name}: {got}"
    if tp.is_leader:
        tp.send({"round": 7, "ids": [1, 2, 3]})
    else:
        assert tp.receive() == {"round": 7, "ids": [1, 2, 3]}
    votes = tp.agree(1, 100 + r)
    assert votes == [(1, 100 + k) for k in range(w)], votes


def sharded_forward(tp: TPGroup, backend: Any, target: str, page_note: str = "") -> None:
    """This rank's part of the target, run over a prompt, gives the whole model's logits
    (float32: equal within rounding, the row-parallel sums add in another order)."""
    from polyspec.model.loader import load_target
    from polyspec.testing.forward import run_prefill

    whole = load_target(Path(target), backend, "float32")
    part = load_target(Path(target), backend, "float32", tp=tp)
    assert part.layout is not None
    held = sum(p.numel() for p in part.parameters())
    total = sum(p.numel() for p in whole.parameters())
    assert held < total, f"rank {tp.rank} holds {held} of {total} weights: not a part"
    ids = torch.tensor([3, 14, 15, 92, 65, 35, 89, 79], device=backend.device())
    _, want = run_prefill(whole, backend, ids)
    _, got = run_prefill(part, backend, ids)
    assert got.shape == want.shape, (got.shape, want.shape)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=page_note or None)


def spec_equals_plain(
    tp: TPGroup, backend: Any, target: str, draft: str, algorithm: str, topk: int, page: int
) -> None:
    """A tensor-parallel speculative engine's greedy output is the unsharded plain engine's
    (rank 0 compares; the other ranks follow)."""
    from polyspec.config import EngineConfig, SamplingParams
    from polyspec.engine.llm import LLM
    from polyspec.testing.forward import assert_greedy_equal

    spec = {"algorithm": algorithm, "num_steps": 3, "topk": topk,
            "num_draft_tokens": 4 if topk > 1 else None}  # fmt: skip
    cfg = EngineConfig(
        target=target, draft=draft, speculative=spec, backend=backend.name, dtype="float32",
        page_size=page, max_batch_size=2, tensor_parallel_size=tp.world_size,
        distributed_timeout_s=60,
    )  # fmt: skip
    llm = LLM(config=cfg)
    if not llm.is_leader:
        llm.follow()
        return
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [40, 41, 42, 43, 44, 45, 46]]
    params = [
        SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (12, 20, 7)
    ]  # three requests on two rows: one joins when another leaves
    got = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    llm.stop_ranks()
    plain = LLM(config=EngineConfig(target=target, backend=backend.name, dtype="float32",
                                    page_size=page, max_batch_size=2))  # fmt: skip
    want = [o.token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=params)]
    ties = assert_greedy_equal(plain.target, backend, prompts, want, got)
    assert ties <= 1, f"{ties} near-ties in {len(prompts)} requests"
