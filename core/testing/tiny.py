"""Session-cached tiny checkpoints for the end-to-end conformance tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny random Llama target and drafts for it, written in the real formats:
    ``target``, ``eagle`` (EAGLE-1, pytorch_model.bin), ``eagle3`` (SpecForge safetensors),
    ``standalone`` (a smaller random LM of the same vocabulary)."""
    from polyspec.testing import builders

    root = tmp_path_factory.mktemp("tiny")
    target = builders.build_tiny_target(root / "target", seed=0)
    return {
        "target": target,
        "eagle": builders.build_tiny_eagle(root / "eagle", target, seed=1),
        "eagle3": builders.build_tiny_eagle3(root / "eagle3", target, seed=2),
        "standalone": builders.build_tiny_standalone(root / "standalone", target, seed=3),
    }
