"""Tiny random checkpoints, written without transformers, for tests and the conformance suite.

- :func:`build_tiny_target`: a Hugging Face directory (config.json, model.safetensors,
  tokenizer.json, tokenizer_config.json with a ChatML chat template) for llama / mistral / qwen2 /
  qwen3. Hidden 64, 4 layers, 4 query / 2 KV heads, vocabulary 300 (a byte-level BPE).
- :func:`build_tiny_eagle`: an EAGLE-1 head in SafeAILab's format (pytorch_model.bin).
- :func:`build_tiny_eagle3`: an EAGLE-3 head in SpecForge's format (safetensors, d2t / t2d).
- :func:`build_tiny_standalone`: a smaller LM sharing the target's tokenizer.
- :func:`build_bigram_models`: in memory, no checkpoint: a target and an EAGLE-1 head that
  drafts it well, so speculative rounds accept several tokens without a trained head.
- :func:`build_off_chain_models`: the same with a head whose first choice is always a decoy,
  so greedy verification accepts second children (off the first-child chain).

Weights are Gaussian with scales chosen so that activations stay O(1) and the next-token
distribution is peaked (logit std about 3): greedy decoding in fp32 does not hit ties.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Common English pairs merged on top of the 256 byte symbols (byte-level BPE, GPT-2 style).
_MERGES = [
    ("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("e", "r"), ("a", "n"), ("o", "n"),
    ("Ġ", "a"), ("r", "e"), ("Ġ", "s"), ("e", "n"), ("a", "t"), ("o", "r"), ("Ġ", "w"),
    ("e", "s"), ("i", "s"), ("Ġ", "o"), ("i", "t"), ("Ġ", "c"), ("a", "l"), ("a", "r"),
    ("Ġ", "b"), ("Ġ", "h"), ("Ġ", "m"), ("e", "d"), ("Ġ", "f"), ("o", "u"), ("l", "e"),
    ("Ġ", "p"), ("Ġ", "d"), ("in", "g"), ("Ġ", "i"), ("Ġ", "n"), ("Ġ", "l"), ("Ġa", "n"),
    ("Ġan", "d"), ("Ġo", "f"), ("Ġt", "o"), ("Ġi", "s"), ("l", "l"), ("Ġ", "he"),
]  # fmt: skip

_ARCH = {
    "llama": ("LlamaForCausalLM", {}),
    "mistral": ("MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2ForCausalLM", {"use_sliding_window": False}),
    "qwen3": ("Qwen3ForCausalLM", {"head_dim": 32, "attention_bias": False}),
}


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte value 0..255."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def _write_tokenizer(path: Path, vocab_size: int) -> int:
    """Write tokenizer.json + tokenizer_config.json; returns the tokenizer's size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for s in _byte_symbols():
        vocab[s] = len(vocab)
    merges = []
    for a, b in _MERGES:
        if len(vocab) >= vocab_size:
            break
        vocab[a + b] = len(vocab)
        merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.save(str(path / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    return len(vocab)


def _randn(g: torch.Generator, *shape: int, std: float) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * std


def _norm(g: torch.Generator, n: int) -> torch.Tensor:
    return 1.0 + _randn(g, n, std=0.1)


def _layer(
    g: torch.Generator, cfg: dict[str, Any], prefix: str, attn_in: int, input_norm: bool = True
) -> dict[str, torch.Tensor]:
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    a, m = prefix + "self_attn.", prefix + "mlp."
    sd = {
        prefix + "post_attention_layernorm.weight": _norm(g, h),
        a + "q_proj.weight": _randn(g, q, attn_in, std=attn_in**-0.5),
        a + "k_proj.weight": _randn(g, kv, attn_in, std=attn_in**-0.5),
        a + "v_proj.weight": _randn(g, kv, attn_in, std=attn_in**-0.5),
        a + "o_proj.weight": _randn(g, h, q, std=0.5 * q**-0.5),
        m + "gate_proj.weight": _randn(g, i, h, std=h**-0.5),
        m + "up_proj.weight": _randn(g, i, h, std=h**-0.5),
        m + "down_proj.weight": _randn(g, h, i, std=0.5 * i**-0.5),
    }
    if input_norm:
        sd[prefix + "input_layernorm.weight"] = _norm(g, h)
    qkv_bias = cfg["model_type"] == "qwen2" or cfg.get("attention_bias")
    if qkv_bias:
        for name, n in (("q", q), ("k", kv), ("v", kv)):
            sd[a + f"{name}_proj.bias"] = _randn(g, n, std=0.1)
    if cfg.get("attention_bias") and cfg["model_type"] != "qwen2":
        sd[a + "o_proj.bias"] = _randn(g, h, std=0.1)
    if cfg["model_type"] == "qwen3":
        sd[a + "q_norm.weight"] = _norm(g, d)
        sd[a + "k_norm.weight"] = _norm(g, d)
    return sd


def _save(sd: dict[str, torch.Tensor], file: Path, dtype: torch.dtype = torch.float32) -> None:
    from safetensors.torch import save_file

    save_file({k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in sd.items()},
              str(file), metadata={"format": "pt"})  # fmt: skip


def build_tiny_target(
    path: str | Path, arch: str = "llama", seed: int = 0, **overrides: Any
) -> Path:
    """Write a tiny random ``arch`` checkpoint to ``path`` (created) and return it.

    ``overrides`` replace config.json fields (e.g. ``num_hidden_layers=2``,
    ``tie_word_embeddings=True``, ``rope_scaling={...}``, ``torch_dtype="bfloat16"``; the
    weights are stored in ``torch_dtype``, float32 by default).
    """
    if arch not in _ARCH:
        raise ValueError(f"arch must be one of {', '.join(_ARCH)}, got {arch!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cls, extra = _ARCH[arch]
    cfg: dict[str, Any] = {
        "architectures": [cls],
        "model_type": arch,
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": "float32",
        **extra,
        **overrides,
    }
    n_tok = _write_tokenizer(path, cfg["vocab_size"])
    if n_tok > cfg["vocab_size"]:
        raise ValueError(f"vocab_size must be at least {n_tok} (the tiny tokenizer's size)")
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    g = torch.Generator().manual_seed(seed)
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    sd = {"model.embed_tokens.weight": _randn(g, v, h, std=0.4)}
    for i in range(cfg["num_hidden_layers"]):
        sd.update(_layer(g, cfg, f"model.layers.{i}.", h))
    sd["model.norm.weight"] = _norm(g, h)
    if not cfg["tie_word_embeddings"]:
        sd["lm_head.weight"] = _randn(g, v, h, std=0.4)
    _save(sd, path / "model.safetensors", getattr(torch, cfg["torch_dtype"]))
    return path


def _target_config(target_path: str | Path) -> dict[str, Any]:
    return json.loads((Path(target_path) / "config.json").read_text())


def _head_config(t: dict[str, Any], **extra: Any) -> dict[str, Any]:
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings",
            "vocab_size", "bos_token_id", "eos_token_id", "torch_dtype")  # fmt: skip
    cfg = {k: t[k] for k in keys if k in t}
    cfg.update(num_hidden_layers=1, hidden_act="silu", **extra)
    return cfg


def build_tiny_eagle(path: str | Path, target_path: str | Path, seed: int = 0) -> Path:
    """An EAGLE-1 head for the target at ``target_path`` (SafeAILab layout: config.json +
    pytorch_model.bin with ``fc.weight``, ``fc.bias``, ``layers.0.*`` without an input norm)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    t = _target_config(target_path)
    cfg = _head_config(t, architectures=["LlamaForCausalLM"], model_type="llama")
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    g = torch.Generator().manual_seed(seed + 1000)
    h = cfg["hidden_size"]
    sd = {"fc.weight": _randn(g, h, 2 * h, std=(2 * h) ** -0.5), "fc.bias": _randn(g, h, std=0.1)}
    sd.update(_layer(g, {**cfg, "model_type": "llama"}, "layers.0.", h, input_norm=False))
    torch.save(sd, path / "pytorch_model.bin")
    return path


def build_tiny_eagle3(
    path: str | Path, target_path: str | Path, seed: int = 0, draft_vocab_size: int | None = None
) -> Path:
    """An EAGLE-3 head for the target (SpecForge layout: config.json with ``draft_vocab_size``
    and ``eagle_config.eagle_aux_hidden_state_layer_ids``; model.safetensors with ``fc``,
    ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``). ``draft_vocab_size`` None = the
    target's whole vocabulary; a smaller one keeps a random subset of ids (sorted)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    t = _target_config(target_path)
    n_layers, v = t["num_hidden_layers"], t["vocab_size"]
    dv = draft_vocab_size or v
    # SpecForge's choice (outputs of layers 1, L/2 - 1, L - 4), clamped for tiny targets.
    aux = [min(max(i, 0), n_layers - 1) for i in (1, n_layers // 2 - 1, n_layers - 4)]
    cfg = _head_config(
        t,
        architectures=["LlamaForCausalLMEagle3"],
        model_type="llama",
        draft_vocab_size=dv,
        target_hidden_size=t["hidden_size"],
        eagle_config={"eagle_aux_hidden_state_layer_ids": aux},
    )
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    g = torch.Generator().manual_seed(seed + 2000)
    h = cfg["hidden_size"]
    sd = {"fc.weight": _randn(g, h, 3 * h, std=(3 * h) ** -0.5)}
    sd.update(_layer(g, {**cfg, "model_type": "llama"}, "midlayer.", 2 * h))
    sd["midlayer.hidden_norm.weight"] = _norm(g, h)
    sd["norm.weight"] = _norm(g, h)
    sd["lm_head.weight"] = _randn(g, dv, h, std=0.4)
    ids = torch.randperm(v, generator=g)[:dv].sort().values
    sd["d2t"] = ids - torch.arange(dv)
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[ids] = True
    sd["t2d"] = t2d
    _save(sd, path / "model.safetensors")
    return path


def build_tiny_standalone(path: str | Path, target_path: str | Path, seed: int = 0) -> Path:
    """A 2-layer, hidden-32 llama sharing the target's vocabulary and tokenizer files."""
    t = _target_config(target_path)
    out = build_tiny_target(
        path, "llama", seed=seed + 3000, vocab_size=t["vocab_size"], hidden_size=32,
        intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(Path(target_path) / name, out / name)
    return out


@torch.no_grad()
def build_bigram_models(
    backend: Any, config: Any = None, seed: int = 0, layer_scale: float = 0.4
) -> tuple[Any, Any]:
    """A fp32 llama target whose next token is mostly a function of the current one, and an
    EAGLE-1 head (``DraftHead("eagle")``) computing exactly that function, built in memory on
    ``backend`` for :meth:`polyspec.LLM.from_modules` (which takes ``algorithm="eagle"``).

    The target's layer outputs (o_proj, down_proj) are scaled by ``layer_scale``, so its final
    hidden state is mostly the current token's embedding, and its final norm weight is all
    ones, so that norm only rescales each row: the "bigram" is the argmax of
    ``lm_head @ embed(token)``. The head's ``fc`` passes the token embedding through and its
    layer adds nothing, so it drafts that argmax: rounds accept 1 to S+1 tokens (the accepted
    paths of topk > 1 trees then need their KV compacted), without a trained head.
    ``config``: a :class:`~polyspec.model.config.ModelConfig` (default: 4 layers, hidden 64,
    vocabulary 64)."""
    from polyspec.model.config import ModelConfig
    from polyspec.model.eagle import DraftHead
    from polyspec.model.llama import CausalLM

    cfg = config or ModelConfig(
        architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=128,
        num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=1024,
        eos_token_ids=(2,),
    ).validate()  # fmt: skip
    dev = backend.device()
    target = CausalLM(cfg, backend.kernels, dev, torch.float32)
    head = DraftHead("eagle", dataclasses.replace(cfg, num_layers=1), target, backend.kernels, dev)
    g = torch.Generator().manual_seed(seed)
    for module in (target, head):
        for name, p in module.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if p.dim() == 1:
                p.copy_(_norm(g, p.shape[0]))
            elif leaf in ("embed_tokens", "lm_head"):
                p.copy_(_randn(g, *p.shape, std=0.4))
            else:
                p.copy_(_randn(g, *p.shape, std=p.shape[1] ** -0.5))
    target.norm.fill_(1.0)
    for layer in target.layers:
        layer.o_proj.mul_(layer_scale)
        layer.down_proj.mul_(layer_scale)
    h = cfg.hidden_size
    head.fc.zero_()
    head.fc[:, :h] = torch.eye(h)  # fc([embed, feature]) = embed
    head.layer.o_proj.zero_()
    head.layer.down_proj.zero_()
    return target.eval(), head.eval()


@torch.no_grad()
def build_off_chain_models(
    backend: Any, seed: int = 5, decoy: int = 63, margin: float = 0.3
) -> tuple[Any, Any]:
    """:func:`build_bigram_models` (layer scale 0.1) with a head that ranks a decoy token
    first and the target's likely next token second, so greedy verification accepts second
    children ("off-chain" branches) round after round, and the accepted path's KV must be
    compacted from scattered tree positions.

    The target's lm_head row of ``decoy`` is zeroed, so the target practically never emits it.
    The head gets its own lm_head: the target's, except the decoy's row ``w``, solved from
    ``embed @ w = best + margin`` where ``best[t]`` is the largest other logit the head gives
    after token t (the head's logit hidden is exactly ``embed[t]``, and a random square
    embedding is invertible), so the decoy leads every draft step by ``margin``."""
    from torch import nn

    target, head = build_bigram_models(backend, seed=seed, layer_scale=0.1)
    lm_head = target.lm_head_weight
    lm_head[decoy] = 0.0
    embed = target.embed_tokens.double()
    logits = embed @ lm_head.double().T  # [t, x]: the head's logits after token t
    logits[:, decoy] = -math.inf
    w = torch.linalg.solve(embed, logits.max(dim=1).values + margin)
    own = lm_head.detach().clone()
    own[decoy] = w.to(own.dtype)
    head.lm_head = nn.Parameter(own, requires_grad=False)
    return target, head
