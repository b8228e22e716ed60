"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) running through a Backend.

Attention goes through ``attn.forward(q, k, v, layer_id, metadata)`` and the small ops through
the backend's :class:`~polyspec.backend.KernelSet`, so the same module runs on every backend.
q/k/v and gate/up projections are fused into one matmul each: on a CPU batch-1 decode the
per-op dispatch cost dominates, so fewer, larger ops are faster.

Weights are loaded from Hugging Face names (``model.layers.0.self_attn.q_proj.weight``, ...)
by :meth:`CausalLM.load_weights`; the GGUF loader maps llama.cpp names onto those first.

Tensor parallel (``tp`` given, docs/distributed.md): each rank holds the part
:class:`~polyspec.parallel.shard.ShardLayout` gives it. q/k/v and gate/up are column parallel
(this rank's heads and MLP rows), o_proj and down_proj row parallel, followed by one all-reduce
each; the embedding and the lm_head are vocabulary parallel (an all-reduce of the looked-up
rows, an all-gather of the logits). Every rank ends each layer with the same residual stream,
so everything downstream (norms, the draft's inputs, sampling) sees the same values on every
rank. :func:`shard_slice` says which part of each checkpoint tensor a rank reads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from polyspec.backend import AttentionBackend, AttentionMetadata, KernelSet, Rotary
from polyspec.errors import ModelLoadError
from polyspec.model.config import ModelConfig
from polyspec.model.linear import linear
from polyspec.model.rope import cos_sin_cache
from polyspec.parallel.group import TPGroup
from polyspec.parallel.shard import ShardLayout

Getter = Callable[[str], torch.Tensor]
"""``get(name)`` returns the named checkpoint tensor or raises ModelLoadError naming it."""


def _param(*shape: int, device: torch.device | None, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype), requires_grad=False)


class DecoderLayer(nn.Module):
    """One pre-norm decoder layer's weights plus its attention and MLP blocks.

    The residual adds and the norms around the blocks are done by the caller, because the
    target, the EAGLE-1 head and the EAGLE-3 head wire them differently.
    ``attn_input_size`` is the width q/k/v read (2H for the EAGLE-3 midlayer).
    """

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        kernels: KernelSet,
        cos_sin: torch.Tensor,  # [max_pos, D] fp32, shared by every layer
        attn_input_size: int | None = None,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        tp: TPGroup | None = None,
        layout: ShardLayout | None = None,
    ) -> None:
        """``tp`` / ``layout``: this rank's group and part (module doc); None: the whole layer."""
        super().__init__()
        c = config
        h_in = attn_input_size or c.hidden_size
        self.layer_id = layer_id
        self.kernels = kernels
        self.cos_sin = cos_sin
        self.tp = tp if layout is not None else None
        self.head_dim = c.head_dim
        if layout is None:
            self.num_heads, self.num_kv_heads = c.num_heads, c.num_kv_heads
            inter = c.intermediate_size
        else:
            self.num_heads, self.num_kv_heads = layout.num_heads, layout.num_kv_heads
            inter = layout.intermediate[1] - layout.intermediate[0]
        self.q_size, self.kv_size = self.num_heads * c.head_dim, self.num_kv_heads * c.head_dim
        self.eps = c.rms_norm_eps
        self.qk_norm = c.qk_norm
        self.input_layernorm = _param(c.hidden_size, device=device, dtype=dtype)
        self.post_attention_layernorm = _param(c.hidden_size, device=device, dtype=dtype)
        qkv = self.q_size + 2 * self.kv_size
        self.qkv_proj = _param(qkv, h_in, device=device, dtype=dtype)
        self.qkv_bias = _param(qkv, device=device, dtype=dtype) if c.attention_bias else None
        self.o_proj = _param(c.hidden_size, self.q_size, device=device, dtype=dtype)
        self.o_bias = _param(c.hidden_size, device=device, dtype=dtype) if c.o_proj_bias else None
        self.q_norm = _param(c.head_dim, device=device, dtype=dtype) if c.qk_norm else None
        self.k_norm = _param(c.head_dim, device=device, dtype=dtype) if c.qk_norm else None
        self.gate_up_proj = _param(2 * inter, c.hidden_size, device=device, dtype=dtype)
        self.down_proj = _param(c.hidden_size, inter, device=device, dtype=dtype)

    def self_attn(
        self,
        x: torch.Tensor,  # [T, h_in] normed input
        positions: torch.Tensor,  # [T]
        attn: AttentionBackend,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        """q/k/v projection (+ Qwen3 q/k norm), RoPE, backend attention, o_proj."""
        t = x.shape[0]
        # One view as heads, then head slices: Tensor.split goes through a Python wrapper that
        # cost ~13 us a layer on the CPU, as much as the layer's norms.
        qkv = linear(x, self.qkv_proj, self.qkv_bias).view(t, -1, self.head_dim)
        hq, hkv = self.num_heads, self.num_kv_heads
        q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
        if self.qk_norm:
            rms = self.kernels.rms_norm
            q = rms(q.reshape(-1, self.head_dim), self.q_norm, self.eps).view(q.shape)
            k = rms(k.reshape(-1, self.head_dim), self.k_norm, self.eps).view(k.shape)
        if attn.rotary_in_forward:  # the backend rotates q and k on their way in
            rotary = Rotary(positions, self.cos_sin, True)
            o = attn.forward(q, k, v, self.layer_id, metadata, rotary=rotary)
        else:
            q, k = self.kernels.rotary_embedding(positions, q, k, self.cos_sin, True)
            o = attn.forward(q, k, v, self.layer_id, metadata)
        if self.tp is None:
            return linear(o.reshape(t, self.q_size), self.o_proj, self.o_bias)
        # Row parallel: this rank's heads' share of o_proj, summed over the ranks; the bias
        # is added once, after the sum.
        out = self.tp.all_reduce(linear(o.reshape(t, self.q_size), self.o_proj))
        return out if self.o_bias is None else out + self.o_bias

    def mlp(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        """SwiGLU MLP with one fused gate/up matmul (row parallel down_proj under tp)."""
        out = linear(self.kernels.silu_and_mul(linear(x, self.gate_up_proj)), self.down_proj)
        return out if self.tp is None else self.tp.all_reduce(out)

    def load_weights(self, get: Getter, prefix: str, skip_input_norm: bool = False) -> None:
        """Copy HF-named weights under ``prefix`` (e.g. ``model.layers.3.``), fusing q/k/v and
        gate/up. ``get(name)`` returns the tensor or raises ModelLoadError naming it."""
        a, m = prefix + "self_attn.", prefix + "mlp."
        if not skip_input_norm:
            _copy(
                self.input_layernorm,
                get(prefix + "input_layernorm.weight"),
                prefix + "input_layernorm.weight",
            )
        _copy(
            self.post_attention_layernorm,
            get(prefix + "post_attention_layernorm.weight"),
            prefix + "post_attention_layernorm.weight",
        )
        qkv_rows = [self.q_size, self.kv_size, self.kv_size]
        _copy_rows(self.qkv_proj, get, [a + f"{x}_proj.weight" for x in "qkv"], qkv_rows)
        if self.qkv_bias is not None:
            _copy_rows(self.qkv_bias, get, [a + f"{x}_proj.bias" for x in "qkv"], qkv_rows)
        _copy(self.o_proj, get(a + "o_proj.weight"), a + "o_proj.weight")
        if self.o_bias is not None:
            _copy(self.o_bias, get(a + "o_proj.bias"), a + "o_proj.bias")
        if self.q_norm is not None:
            _copy(self.q_norm, get(a + "q_norm.weight"), a + "q_norm.weight")
            _copy(self.k_norm, get(a + "k_norm.weight"), a + "k_norm.weight")
        inter = self.down_proj.shape[1]
        _copy_rows(
            self.gate_up_proj, get, [m + "gate_proj.weight", m + "up_proj.weight"], [inter, inter]
        )
        _copy(self.down_proj, get(m + "down_proj.weight"), m + "down_proj.weight")


def _copy(dst: torch.Tensor, src: torch.Tensor | None, name: str) -> None:
    if src is None:
        raise ModelLoadError(f"missing tensor {name}")
    if tuple(src.shape) != tuple(dst.shape):
        raise ModelLoadError(
            f"tensor {name} has shape {tuple(src.shape)}, the config implies {tuple(dst.shape)} "
            "(config.json and the weights disagree)"
        )
    with torch.no_grad():
        dst.copy_(src)


def _copy_rows(dst: torch.Tensor, get: Getter, names: list[str], rows: list[int]) -> None:
    """Fill a fused weight from ``names`` stacked along dim 0 (``rows[i]`` rows each) without a
    temporary cat; each part's shape is checked on its own so a mismatch names the right tensor."""
    start = 0
    for name, n in zip(names, rows):
        _copy(dst[start : start + n], get(name), name)
        start += n


def make_getter(tensors: Mapping[str, torch.Tensor]) -> Getter:
    """A ``get(name)`` over ``tensors``; ``model.x`` also matches a bare ``x`` (checkpoints
    differ in that prefix). A missing name raises ModelLoadError naming it."""

    def get(name: str) -> torch.Tensor:
        if name in tensors:
            return tensors[name]
        if name.startswith("model.") and name[6:] in tensors:
            return tensors[name[6:]]
        raise ModelLoadError(f"missing tensor {name}")

    return get


class CausalLM(nn.Module):
    """The target model (and the standalone draft): embeddings, decoder layers, norm, lm_head."""

    def __init__(
        self,
        config: ModelConfig,
        kernels: KernelSet,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        max_positions: int | None = None,
        tp: TPGroup | None = None,
    ) -> None:
        """``tp``: hold this rank's part of the model (module doc); None or a group of one
        rank: the whole model."""
        super().__init__()
        c = config
        self.config = c
        if tp is not None and tp.world_size > 1:
            self.tp: TPGroup | None = tp
            self.layout: ShardLayout | None = ShardLayout.of(
                tp.rank, tp.world_size, c.num_heads, c.num_kv_heads, c.intermediate_size,
                c.vocab_size,
            )  # fmt: skip
            rows = self.layout.vocab[1] - self.layout.vocab[0]
        else:
            self.tp, self.layout, rows = None, None, c.vocab_size
        self.kernels = kernels
        self.eps = c.rms_norm_eps
        device = torch.device(device) if device is not None else None
        self.register_buffer(
            "cos_sin_cache",
            cos_sin_cache(
                c.head_dim,
                max_positions or c.max_position_embeddings,
                c.rope_theta,
                c.rope_scaling,
                device,
            ),
            persistent=False,
        )
        self.embed_tokens = _param(rows, c.hidden_size, device=device, dtype=dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(
                c,
                i,
                self.kernels,
                self.cos_sin_cache,
                device=device,
                dtype=dtype,
                tp=self.tp,
                layout=self.layout,
            )  # fmt: skip
            for i in range(c.num_layers)
        )
        self.norm = _param(c.hidden_size, device=device, dtype=dtype)
        self.lm_head = (
            None
            if c.tie_word_embeddings
            else _param(rows, c.hidden_size, device=device, dtype=dtype)
        )

    @property
    def lm_head_weight(self) -> torch.Tensor:  # [V, H] ([V / W, H]: this rank's rows under tp)
        return self.embed_tokens if self.lm_head is None else self.lm_head

    @property
    def local_heads(self) -> tuple[int, int]:
        """(query heads, key/value heads) this rank's attention and KV pool hold."""
        return self.layers[0].num_heads, self.layers[0].num_kv_heads

    def _vocab_mask(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids as rows of this rank's vocabulary part, 0 where outside; True where outside)."""
        start, stop = self.layout.vocab
        outside = (ids < start) | (ids >= stop)
        return (ids - start).masked_fill(outside, 0), outside

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        """Token embeddings (vocabulary parallel under tp: each rank looks up the ids it holds,
        zeros elsewhere, summed over the ranks, so the sum is exact)."""
        if self.tp is None:
            return F.embedding(input_ids, self.embed_tokens)
        local, outside = self._vocab_mask(input_ids)
        out = F.embedding(local, self.embed_tokens).masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(out)

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, V]
        """lm_head over hidden states, in the weight's dtype; the whole vocabulary on every
        rank (under tp, each rank's columns gathered: once per call)."""
        logits = linear(hidden, self.lm_head_weight)
        return logits if self.tp is None else self.tp.all_gather_last(logits)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, V] fp32
        """lm_head over final normed hidden states, returned in float32."""
        return self.lm_logits(hidden).float()

    def lm_head_rows(self, ids: torch.Tensor) -> torch.Tensor:  # [m] int64 -> [m, H]
        """Rows ``ids`` of the whole lm_head (an EAGLE head's hot-token copy), on every rank."""
        if self.tp is None:
            return self.lm_head_weight.detach()[ids].clone()
        local, outside = self._vocab_mask(ids)
        rows = self.lm_head_weight.detach()[local].masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(rows)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        attn: AttentionBackend,
        metadata: AttentionMetadata,
        capture_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # ([T, H], [T, len(capture_layers) * H] | None)
        """Run the decoder. ``capture_layers`` lists layer indices whose INPUT (residual stream
        before that layer's norm) is returned concatenated in the given order; index
        ``num_layers`` is the final pre-norm output."""
        k = self.kernels
        eps = self.eps
        captured: dict[int, torch.Tensor] = {}
        if capture_layers:
            bad = [i for i in capture_layers if not 0 <= i <= self.config.num_layers]
            if bad:
                raise ValueError(f"capture_layers {bad} out of range 0..{self.config.num_layers}")
        hidden = self.embed(input_ids)
        residual = None
        for i, layer in enumerate(self.layers):
            if residual is None:
                residual = hidden
                x = k.rms_norm(hidden, layer.input_layernorm, eps)
            else:
                x, residual = k.fused_add_rms_norm(hidden, residual, layer.input_layernorm, eps)
            if capture_layers and i in capture_layers:
                captured[i] = residual
            h = layer.self_attn(x, positions, attn, metadata)
            x, residual = k.fused_add_rms_norm(h, residual, layer.post_attention_layernorm, eps)
            hidden = layer.mlp(x)
        out, residual = k.fused_add_rms_norm(hidden, residual, self.norm, eps)
        if not capture_layers:
            return out, None
        captured[self.config.num_layers] = residual
        return out, torch.cat([captured[i] for i in capture_layers], dim=-1)

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy a Hugging Face state dict (``model.``-prefixed or not) into this model.

        Raises ModelLoadError listing every missing tensor, or naming a tensor whose shape does
        not match the config.
        """
        missing = missing_tensors(self.config, tensors)
        if missing:
            shown = ", ".join(missing[:10]) + (
                f" (and {len(missing) - 10} more)" if len(missing) > 10 else ""
            )
            raise ModelLoadError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")
        get = make_getter(tensors)
        _copy(self.embed_tokens, get("model.embed_tokens.weight"), "model.embed_tokens.weight")
        _copy(self.norm, get("model.norm.weight"), "model.norm.weight")
        if self.lm_head is not None:
            _copy(self.lm_head, tensors["lm_head.weight"], "lm_head.weight")
        for i, layer in enumerate(self.layers):
            layer.load_weights(get, f"model.layers.{i}.")


_COLUMN_PARALLEL = {"self_attn.q_proj": "q", "self_attn.k_proj": "kv", "self_attn.v_proj": "kv",
                    "mlp.gate_proj": "mlp", "mlp.up_proj": "mlp"}  # fmt: skip
_ROW_PARALLEL = {"self_attn.o_proj.weight": "q", "mlp.down_proj.weight": "mlp"}


def shard_slice(name: str, config: ModelConfig, layout: ShardLayout) -> tuple[int, int, int] | None:
    """(dim, start, stop): the slice of checkpoint tensor ``name`` (a Hugging Face name, with
    or without ``model.``) that the rank of ``layout`` holds; None for a replicated tensor."""
    bare = name.removeprefix("model.")
    if bare in ("embed_tokens.weight", "lm_head.weight"):
        return (0, *layout.vocab)
    if not bare.startswith("layers."):
        return None
    part = bare.split(".", 2)[2]  # "self_attn.q_proj.weight"
    d = config.head_dim
    ranges = {"q": tuple(d * i for i in layout.q_heads),
              "kv": tuple(d * i for i in layout.kv_heads), "mlp": layout.intermediate}  # fmt: skip
    module, _, leaf = part.rpartition(".")
    if module in _COLUMN_PARALLEL and leaf in ("weight", "bias"):
        return (0, *ranges[_COLUMN_PARALLEL[module]])
    if part in _ROW_PARALLEL:
        return (1, *ranges[_ROW_PARALLEL[part]])
    return None


def expected_tensors(config: ModelConfig) -> list[str]:
    """HF names (with ``model.`` prefix) a checkpoint of ``config`` must contain."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        if config.attention_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        if config.o_proj_bias:
            names.append(p + "self_attn.o_proj.bias")
        if config.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
    return names


def missing_tensors(config: ModelConfig, tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Expected names absent from ``tensors`` (a name also counts without its ``model.`` prefix)."""
    out = []
    for n in expected_tensors(config):
        if n not in tensors and not (n.startswith("model.") and n[6:] in tensors):
            out.append(n)
    return out
