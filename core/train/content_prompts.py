"""Prompts that carry content: a text the target wrote, with a task on it.

Self-written prompts (``self_prompts``) are short, and rarely hold anything the answer must
reuse. Chat benchmarks often do: a passage to summarise or extract from, an email to rewrite,
code to explain or fix. On such answers a head trained on short-prompt text falls short most
on the tokens the answer takes from the prompt (docs/training.md, "Where the shortfall is").
These prompts put one of the target's earlier answers (``answers.jsonl`` of a train-draft
run) into a task of our own wording, before or after the text, so the target's answer reuses
it; prompt and answer stay the target's own text.
"""

from __future__ import annotations

import random

from polyspec.errors import ConfigError

TEXT_TASKS: tuple[str, ...] = (
    "Summarize the following text in a few sentences.\n\n{text}",
    "{text}\n\nWhat are the three most important points of the text above?",
    "Rewrite the following text in a more formal tone.\n\n{text}",
    "Extract every name, number and date from this text and list them.\n\n{text}",
    "Read the passage below and write three questions about it, each with its answer.\n\n{text}",
    "{text}\n\nSuggest a title for this text and explain your choice.",
    "Rewrite this text so that a ten-year-old can understand it:\n\n{text}",
    "Turn the following text into a short email to a colleague.\n\n{text}",
    "{text}\n\nWhat could be improved in the text above? Give specific suggestions.",
    "Continue this text with one more paragraph:\n\n{text}",
    "List the key ideas of the following text as bullet points.\n\n{text}",
    "Given the following text, what is its main argument, and what supports it?\n\n{text}",
)
CODE_TASKS: tuple[str, ...] = (
    "Explain what the following code does, step by step.\n\n{text}",
    "{text}\n\nAre there any bugs or edge cases in the code above? How would you fix them?",
    "Add comments and docstrings to this code:\n\n{text}",
    "Rewrite the following code to make it clearer or faster.\n\n{text}",
    "{text}\n\nWrite unit tests for the code above.",
)


# Openings of refusals and apologies: poor texts to work on, and the target writes many.
_REFUSALS = ("i'm sorry", "i am sorry", "i apologize", "as an ai", "i'm not able", "i can't",
             "i cannot", "unfortunately")  # fmt: skip


def content_prompts(
    answers: list[dict],  # records of an answers.jsonl: {"prompt_ids", "answer_ids"}
    decode,  # token ids -> text (the target's tokenizer)
    num: int,
    seed: int = 0,
    min_tokens: int = 48,
    max_tokens: int = 256,
) -> list[str]:
    """``num`` prompts (fewer if fewer answers qualify), each an answer of ``min_tokens`` to
    ``max_tokens`` tokens inside a task; answers holding a fenced code block get a code task.
    Answers that open with a refusal or an apology are left out. Answers are drawn without
    repeats in a ``seed``-fixed order, tasks in turn."""
    if num < 1:
        raise ConfigError(f"--content-prompts must be >= 1, got {num}")
    usable = [a for a in answers if min_tokens <= len(a["answer_ids"]) <= max_tokens]
    if not usable:
        raise ConfigError(
            f"no answer of {min_tokens}-{max_tokens} tokens to build content prompts from: "
            "pass the answers.jsonl of a run with longer answers"
        )
    random.Random(seed).shuffle(usable)
    out: list[str] = []
    counts = {"text": 0, "code": 0}
    for rec in usable:
        if len(out) == num:
            break
        text = decode(rec["answer_ids"]).strip()
        if text.lower().startswith(_REFUSALS):
            continue
        kind, tasks = ("code", CODE_TASKS) if "```" in text else ("text", TEXT_TASKS)
        out.append(tasks[counts[kind] % len(tasks)].format(text=text))
        counts[kind] += 1
    return out
