"""Training prompts written by the target itself (the Magpie recipe, Xu et al. 2024).

An instruction-tuned model given only the chat template's opening of a user turn writes a
plausible user message. Sampled many times this gives a large, varied prompt set drawn from
the chat distribution the model was tuned on, which a few hundred public instructions cover
thinly. The answers to these prompts (``data.generate_answers``) are then the head's training
text, as for file prompts.

Prompts are appended to ``out_file`` as they finish (one JSON object per line, with the job
index and finish reason), so an interrupted run resumes where it stopped; only prompts that
ended with an end-of-turn (not cut at the length cap), have at least ``min_words`` words and
are not exact repeats are kept.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from polyspec.config import SamplingParams
from polyspec.errors import ConfigError

_SENTINEL = "\u2063polyspec-user-turn\u2063"


def user_turn_prefix(tokenizer) -> list[int]:
    """Token ids of the chat template up to where the user's text would begin."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": _SENTINEL}], add_generation_prompt=False
    )
    cut = text.find(_SENTINEL)
    if cut <= 0:
        raise ConfigError(
            "the target's chat template does not place the user's text where a prompt prefix "
            "can be cut off; --self-prompts needs a chat model"
        )
    return tokenizer.encode(text[:cut], add_special_tokens=False)


def generate_self_prompts(
    llm,
    num_prompts: int,
    out_file: Path,
    batch_size: int,
    temperature: float = 1.0,
    top_p: float = 0.95,
    max_new_tokens: int = 96,
    seed: int = 0,
    min_words: int = 3,
    progress: Callable[[int], None] | None = None,
    openers: tuple[str, ...] = ("",),
) -> list[str]:
    """``num_prompts`` sampling jobs (seeded: a rerun writes the same text); returns the kept,
    de-duplicated prompts in job order. Job ``j`` starts the user's text with
    ``openers[j % len(openers)]`` (see ``openers.py``); the kept prompt includes it."""
    if num_prompts < 1:
        raise ConfigError(f"--self-prompts must be >= 1, got {num_prompts}")
    if not openers:
        raise ConfigError("self prompts: openers must hold at least one entry ('' is a plain draw)")
    prefix = user_turn_prefix(llm.tokenizer)
    opener_ids = {
        o: llm.tokenizer.encode(o, add_special_tokens=False) if o else [] for o in openers
    }

    def opener(j: int) -> str:
        return openers[j % len(openers)]

    done: dict[int, dict] = {}
    if out_file.is_file():
        for line in out_file.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                break  # a line cut short by an interruption: regenerate from here
            if rec.get("opener", "") == opener(rec["index"]):  # else: another opener list
                done[rec["index"]] = rec
    todo = [j for j in range(num_prompts) if j not in done]
    if progress:
        progress(num_prompts - len(todo))
    with out_file.open("a") as f:
        # Several batches per generate call: the engine refills finished rows at once, so the
        # batch does not drain to its longest answer before the next one starts.
        chunk_size = 4 * batch_size
        for start in range(0, len(todo), chunk_size):
            chunk = todo[start : start + chunk_size]
            params = [
                SamplingParams(
                    max_new_tokens=max_new_tokens,
                    temperature=temperature,
                    top_p=top_p,
                    seed=seed * 104729 + j,
                )  # fmt: skip
                for j in chunk
            ]
            ids = [prefix + opener_ids[opener(j)] for j in chunk]
            outs = llm.generate(prompt_token_ids=ids, sampling_params=params)
            for j, o in zip(chunk, outs):
                text = (opener(j) + o.text).strip()
                rec = {"index": j, "prompt": text, "finish_reason": o.finish_reason}
                if opener(j):
                    rec["opener"] = opener(j)
                done[j] = rec
                f.write(json.dumps(rec) + "\n")
            f.flush()
            if progress:
                progress(len(chunk))
    kept, seen = [], set()
    for j in range(num_prompts):
        rec = done[j]
        text = rec["prompt"]
        too_short = len(text.split()) < min_words + len(opener(j).split())
        if rec["finish_reason"] != "stop" or too_short or text in seen:
            continue
        seen.add(text)
        kept.append(text)
    return kept
