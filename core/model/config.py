"""ModelConfig: the shape of a Llama-family decoder, parsed from HF config.json or GGUF metadata.

Supported architectures: Llama 2/3 (``llama``), Mistral (``mistral``), Qwen2/2.5 (``qwen2``,
q/k/v bias) and Qwen3 (``qwen3``, per-head q/k RMSNorm). Anything else is refused with a
:class:`~polyspec.errors.ModelLoadError` naming the architecture.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from polyspec.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")

# HF `architectures` class names and `model_type` values we accept, mapped to our architecture.
_HF_ARCH = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

DEFAULT_ROPE_THETA = 10000.0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything the model code needs to know about a checkpoint's shape (frozen)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = DEFAULT_ROPE_THETA
    rope_scaling: dict[str, Any] | None = None
    """None, or a dict with ``rope_type`` "linear" / "llama3" / "freq_factors" and its parameters."""
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """q/k/v projections carry a bias (always for qwen2; ``attention_bias`` for the others)."""
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    o_proj_bias: bool = False
    """o_proj carries a bias (Llama/Mistral/Qwen3 with ``attention_bias: true``; never qwen2)."""

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attn_scale(self) -> float:
        """Softmax scale of every attention layer (``head_dim ** -0.5``)."""
        return self.head_dim**-0.5

    def validate(self) -> ModelConfig:
        """Raise ModelLoadError when the numbers cannot describe a working model."""
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {self.architecture!r}; polyspec supports "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers"):
            if getattr(self, name) <= 0:
                raise ModelLoadError(
                    f"config field {name} must be positive, got {getattr(self, name)}"
                )
        if self.num_heads <= 0 or self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_heads ({self.num_heads}) must be a positive multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ModelLoadError(f"head_dim must be a positive even number, got {self.head_dim}")
        return self


def _eos_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def normalize_rope_scaling(raw: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Canonical rope scaling dict (``rope_type`` key), or None for plain RoPE.

    Accepts both the transformers<5 ``rope_scaling`` dict (``type`` or ``rope_type``) and the
    transformers>=5 ``rope_parameters`` dict (which also carries ``rope_theta``).
    """
    if not raw:
        return None
    rope_type = raw.get("rope_type", raw.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type == "linear":
        return {"rope_type": "linear", "factor": float(raw["factor"])}
    if rope_type == "llama3":
        try:
            return {
                "rope_type": "llama3",
                "factor": float(raw["factor"]),
                "low_freq_factor": float(raw["low_freq_factor"]),
                "high_freq_factor": float(raw["high_freq_factor"]),
                "original_max_position_embeddings": int(raw["original_max_position_embeddings"]),
            }
        except KeyError as e:
            raise ModelLoadError(
                f"llama3 rope scaling is missing the field {e.args[0]!r}"
            ) from None
    raise ModelLoadError(
        f"unsupported rope scaling type {rope_type!r}; supported: default, linear, llama3"
    )


def config_from_hf(cfg: Mapping[str, Any]) -> ModelConfig:
    """ModelConfig from a parsed Hugging Face ``config.json`` (transformers 4.x or 5.x layout)."""
    arch = _HF_ARCH.get(str((cfg.get("architectures") or [""])[0]))
    if arch is None:
        arch = cfg.get("model_type")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture {(cfg.get('architectures') or [cfg.get('model_type')])[0]!r}; "
            f"polyspec supports {', '.join(_HF_ARCH)} (model_type {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if cfg.get("mlp_bias"):
        raise ModelLoadError(
            "mlp_bias=true is not supported (no Llama-family model polyspec targets uses it)"
        )
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        rope_params = cfg.get("rope_parameters") or {}
        rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", DEFAULT_ROPE_THETA))
        bias = bool(cfg.get("attention_bias", False))
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=normalize_rope_scaling(cfg.get("rope_scaling") or rope_params),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=True if arch == "qwen2" else bias,
            o_proj_bias=False if arch == "qwen2" else bias,
            qk_norm=arch == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_eos_tuple(cfg.get("eos_token_id")),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        ).validate()
    except KeyError as e:
        raise ModelLoadError(f"config.json lacks the required field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"config.json has an invalid value: {e}") from None


_GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def config_from_gguf(meta: Mapping[str, Any], tensor_names: frozenset[str]) -> ModelConfig:
    """ModelConfig from GGUF metadata (``{key: python value}``) and the file's tensor names.

    Only ``general.architecture == "llama"`` files are supported (Llama/Mistral/SmolLM exports).
    A ``rope_freqs.weight`` tensor (llama.cpp's Llama-3.1 rope factors) becomes a
    ``freq_factors`` rope scaling filled in by the GGUF loader.
    """
    gguf_arch = meta.get("general.architecture")
    if gguf_arch != "llama":
        raise ModelLoadError(
            f"unsupported GGUF architecture {gguf_arch!r}; polyspec reads llama-architecture GGUF "
            "files (Llama, Mistral, SmolLM); use the Hugging Face checkpoint for other models"
        )

    def key(name: str, default: Any = ...) -> Any:
        full = f"{gguf_arch}.{name}"
        if full in meta:
            return meta[full]
        if default is ...:
            raise ModelLoadError(f"GGUF metadata lacks the required key {full!r}")
        return default

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    vocab = key("vocab_size", None)
    if vocab is None:
        vocab = len(meta.get("tokenizer.ggml.tokens") or ())
    eos = meta.get("tokenizer.ggml.eos_token_id")
    extra_eos = [
        meta.get(k) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    ]
    eos_ids = tuple(dict.fromkeys(int(x) for x in [eos, *extra_eos] if x is not None))
    return ModelConfig(
        architecture=_GGUF_ARCH[gguf_arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(key("attention.key_length", hidden // heads)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", DEFAULT_ROPE_THETA)),
        rope_scaling=None,
        max_position_embeddings=int(key("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        o_proj_bias="blk.0.attn_output.bias" in tensor_names,
        qk_norm=False,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_ids,
        torch_dtype=None,
    ).validate()
