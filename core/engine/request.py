"""A generation request and what it returns."""

from __future__ import annotations

import dataclasses
import time

from polyspec.config import SamplingParams


@dataclasses.dataclass
class RequestStats:
    """Per-request speculative statistics (plain decoding: one token per round)."""

    accepted_per_round: list[int]  # tokens committed by each decode round (accepted + bonus)
    num_rounds: int
    mean_acceptance_length: float  # mean tokens per round, the first (prefill) token excluded
    time_s: float  # arrival to finish
    time_to_first_token_s: float


@dataclasses.dataclass
class RequestOutput:
    """What ``LLM.generate`` returns for one prompt."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]  # generated ids only
    # "stop" (EOS, stop token or stop string), "length" (max_new_tokens), "abort" (aborted or
    # the engine shut down first) or "error" (the cause in ``error``; the other requests ran on)
    finish_reason: str
    stats: RequestStats
    error: str | None = None


@dataclasses.dataclass
class Request:
    rid: int
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = dataclasses.field(default_factory=list)
    accepted_per_round: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_text_end: int | None = None  # where a matched stop string begins in the text
    error: str | None = None  # the cause, when finish_reason == "error"
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
