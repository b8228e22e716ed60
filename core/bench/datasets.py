"""Benchmark prompt sets: MT-bench (shipped with polyspec) or a user JSONL file."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from polyspec.errors import ConfigError

MT_BENCH = "mt_bench"
MT_BENCH_RELPATH = Path("eval") / "mt_bench.jsonl"
MT_BENCH_PACKAGED = Path(__file__).resolve().parent / "data" / "mt_bench.jsonl"
"""The 80 MT-bench questions of lm-sys/FastChat (Apache-2.0; data/README.md)."""
MT_BENCH_URL = (
    "https://raw.githubusercontent.com/lm-sys/FastChat/main/fastchat/llm_judge/data/mt_bench/"
    "question.jsonl"
)


def mt_bench_candidates(
    env: Mapping[str, str] | None = None, packaged: Path = MT_BENCH_PACKAGED
) -> list[Path]:
    """Where ``--dataset mt_bench`` looks, in order: ``$POLYSPEC_DATA_DIR/eval/mt_bench.jsonl``
    (a copy of the user's own), then the file shipped in this package."""
    env = os.environ if env is None else env
    out = []
    if env.get("POLYSPEC_DATA_DIR"):
        out.append(Path(env["POLYSPEC_DATA_DIR"]) / MT_BENCH_RELPATH)
    out.append(packaged)
    return out


def find_mt_bench(env: Mapping[str, str] | None = None, packaged: Path = MT_BENCH_PACKAGED) -> Path:
    """The MT-bench question file; a :class:`ConfigError` saying how to get it when absent."""
    candidates = mt_bench_candidates(env, packaged)
    for path in candidates:
        if path.is_file():
            return path
    looked = ", ".join(str(p) for p in candidates)
    raise ConfigError(
        f"dataset 'mt_bench' not found (looked in {looked}). Download it with "
        f"`curl -o mt_bench.jsonl {MT_BENCH_URL}` and pass --dataset mt_bench.jsonl, or put it "
        "at $POLYSPEC_DATA_DIR/eval/mt_bench.jsonl"
    )


def read_prompts(path: str | Path) -> list[str]:
    """First-turn prompts of a JSONL file: one object per line with ``turns`` (a list of
    strings; the first is used) or ``prompt`` (a string). Blank lines are skipped."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"dataset file {path} does not exist; pass 'mt_bench' or a JSONL file with one "
            '{"prompt": ...} or {"turns": [...]} object per line'
        )
    prompts = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if line.strip():
                prompts.append(_prompt_of_line(line, path, lineno))
    if not prompts:
        raise ConfigError(f"dataset file {path} has no prompts (it is empty)")
    return prompts


def _prompt_of_line(line: str, path: Path, lineno: int) -> str:
    where = f"{path} line {lineno}"
    try:
        obj = json.loads(line)
    except ValueError as exc:
        raise ConfigError(f"{where} is not valid JSON ({exc}); fix or remove that line") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{where} must be a JSON object, got {type(obj).__name__}")
    if "turns" in obj:
        turns = obj["turns"]
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
            raise ConfigError(f"{where}: 'turns' must be a non-empty list of strings")
        prompt = turns[0]
    elif "prompt" in obj:
        prompt = obj["prompt"]
        if not isinstance(prompt, str):
            raise ConfigError(f"{where}: 'prompt' must be a string, got {type(prompt).__name__}")
    else:
        raise ConfigError(
            f"{where} has neither 'turns' nor 'prompt' (keys: {', '.join(obj) or 'none'})"
        )
    if not prompt.strip():
        raise ConfigError(f"{where}: the prompt is empty")
    return prompt


def load_dataset(name: str, num_prompts: int | None = None) -> tuple[Path, list[str]]:
    """(file, prompts) for ``--dataset``: ``mt_bench`` or a JSONL path; the first
    ``num_prompts`` prompts (all when None)."""
    if num_prompts is not None and num_prompts < 1:
        raise ConfigError(f"--num-prompts = {num_prompts} is invalid: must be >= 1")
    path = find_mt_bench() if name == MT_BENCH else Path(name)
    prompts = read_prompts(path)
    return path, prompts if num_prompts is None else prompts[:num_prompts]


def read_categories(path: str | Path) -> list[str | None]:
    """The ``category`` of each prompt line of a dataset file (None where a line has none),
    aligned with :func:`read_prompts` (MT-bench has writing, roleplay, reasoning, ...)."""
    out: list[str | None] = []
    with Path(path).open() as f:
        for line in f:
            if line.strip():
                obj = json.loads(line)
                cat = obj.get("category") if isinstance(obj, dict) else None
                out.append(cat if isinstance(cat, str) and cat else None)
    return out
