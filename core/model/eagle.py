"""EAGLE draft heads: EAGLE-1/2 (``"eagle"``) and EAGLE-3 (``"eagle3"``).

Semantics follow SGLang's llama_eagle.py / llama_eagle3.py:

- eagle: ``h = fc(cat[embed(ids), features])``; one decoder layer whose input norm is skipped;
  output = mlp_out + residual (no final norm); it is both the logit hidden (through the
  target's lm_head, optionally trimmed to a hot-token subset) and the next step's feature.
- eagle3: features of width != H go through ``fc`` (3H -> H, no bias); the layer attends over
  ``cat[input_layernorm(embed(ids)), hidden_norm(features)]`` (2H wide q/k/v); after the MLP,
  the fused ``norm`` gives (logit hidden, next feature = pre-norm sum); the head's own lm_head
  covers ``draft_vocab_size`` ids and ``d2t`` maps draft id i to target id ``i + d2t[i]``.

Under tensor parallelism a head is replicated on every rank (its one layer is small; its
inputs, the target's hidden states, are the same on every rank), while what it borrows from
the target stays the target's vocabulary-parallel embedding and lm_head: it goes through
:meth:`CausalLM.embed` and :meth:`CausalLM.lm_logits`, never the target's weight tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from polyspec.backend import AttentionBackend, AttentionMetadata, KernelSet
from polyspec.model.config import ModelConfig
from polyspec.model.linear import linear
from polyspec.model.llama import CausalLM, DecoderLayer, _param


class DraftHead(nn.Module):
    """A one-layer EAGLE draft head bound to its target model (shares embeddings / lm_head)."""

    def __init__(
        self,
        algorithm: str,
        config: ModelConfig,
        target: CausalLM,
        kernels: KernelSet | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        target_hidden_size: int | None = None,
        fc_bias: bool = False,
        own_embed: bool = False,
        draft_vocab_size: int | None = None,
        aux_layer_ids: tuple[int, ...] = (),
        max_positions: int | None = None,
    ) -> None:
        super().__init__()
        if algorithm not in ("eagle", "eagle3"):
            raise ValueError(f"algorithm must be 'eagle' or 'eagle3', got {algorithm!r}")
        self.algorithm = algorithm
        self.config = config
        self.kernels = kernels or target.kernels
        self.eps = config.rms_norm_eps
        device = torch.device(device) if device is not None else None
        h = config.hidden_size
        th = target_hidden_size or h
        eagle3 = algorithm == "eagle3"
        self.target_feature_size = 3 * th if eagle3 else th
        self.aux_layer_ids = tuple(aux_layer_ids) if eagle3 else ()
        # The target is referenced, not registered: its weights are not the head's parameters.
        object.__setattr__(self, "_target", target)
        from polyspec.model.rope import cos_sin_cache

        self.register_buffer(
            "cos_sin_cache",
            cos_sin_cache(
                config.head_dim,
                max_positions or config.max_position_embeddings,
                config.rope_theta,
                config.rope_scaling,
                device,
            ),
            persistent=False,
        )
        self.fc = _param(h, 3 * th if eagle3 else 2 * h, device=device, dtype=dtype)
        self.fc_bias = _param(h, device=device, dtype=dtype) if fc_bias and not eagle3 else None
        self.embed_tokens = (
            _param(config.vocab_size, h, device=device, dtype=dtype) if own_embed else None
        )
        self.layer = DecoderLayer(
            config, 0, self.kernels, self.cos_sin_cache, 2 * h if eagle3 else None, device, dtype
        )
        self.hidden_norm = _param(h, device=device, dtype=dtype) if eagle3 else None
        self.norm = _param(h, device=device, dtype=dtype) if eagle3 else None
        self.draft_vocab_size = draft_vocab_size or target.config.vocab_size
        self.lm_head: nn.Parameter | None = (
            _param(self.draft_vocab_size, h, device=device, dtype=dtype) if eagle3 else None
        )
        # draft id -> target id ([draft_vocab_size] int64), or None when the vocabularies agree.
        self.register_buffer("draft_to_target", None, persistent=False)

    def own_matrices(self) -> list[nn.Parameter]:
        """The weight matrices the head owns and multiplies by (fc, the layer's projections, its
        own lm_head), not the target's it borrows: what draft quantization may replace."""
        layer = self.layer
        out = [self.fc, layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj]
        if self.lm_head is not None:
            out.append(self.lm_head)
        return out

    @property
    def embed_weight(self) -> torch.Tensor:  # [V, H]
        return self.embed_tokens if self.embed_tokens is not None else self._target.embed_tokens

    @property
    def lm_head_weight(self) -> torch.Tensor:  # [V_draft, H]
        return self.lm_head if self.lm_head is not None else self._target.lm_head_weight

    def set_token_map(self, draft_to_target: torch.Tensor | None) -> None:  # [V_draft] int64
        """Install the draft-vocabulary -> target id map; for eagle, also trims the lm_head
        (a copy of the target's rows) to those ids."""
        if draft_to_target is None:
            self.draft_to_target = None
            return
        m = draft_to_target.to(device=self.fc.device, dtype=torch.int64)
        self.draft_to_target = m
        if self.algorithm == "eagle":
            self.lm_head = nn.Parameter(self._target.lm_head_rows(m), requires_grad=False)
        self.draft_vocab_size = int(m.numel())

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] token after each feature's position
        features: torch.Tensor,  # [T, target_feature_size] or [T, H]
        positions: torch.Tensor,  # [T]
        attn: AttentionBackend,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (logit_hidden [T, H], next_feature [T, H])
        """One draft step over T tokens."""
        k, eps, layer = self.kernels, self.eps, self.layer
        if self.algorithm == "eagle":
            h = linear(torch.cat([self._embed(input_ids), features], dim=-1), self.fc, self.fc_bias)
            a = layer.self_attn(h, positions, attn, metadata)
            x, residual = k.fused_add_rms_norm(a, h, layer.post_attention_layernorm, eps)
            out = layer.mlp(x) + residual
            return out, out
        if features.shape[-1] != self.config.hidden_size:
            features = linear(features, self.fc)
        if self.embed_tokens is None and self._target.tp is not None:
            # the target's vocabulary-parallel lookup (summed over the ranks) comes first
            e = k.rms_norm(self._target.embed(input_ids), layer.input_layernorm, eps)
            x = torch.cat([e, k.rms_norm(features, self.hidden_norm, eps)], dim=-1)
        else:  # one kernel (a draft step's launches are most of its cost at small batches)
            x = k.draft_layer_input(
                input_ids, self.embed_weight, features, layer.input_layernorm, self.hidden_norm,
                eps,
            )  # fmt: skip
        a = layer.self_attn(x, positions, attn, metadata)
        x, residual = k.fused_add_rms_norm(a, features, layer.post_attention_layernorm, eps)
        normed, pre = k.fused_add_rms_norm(layer.mlp(x), residual, self.norm, eps)
        return normed, pre

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        """Token embeddings: the head's own table, else the target's lookup."""
        if self.embed_tokens is not None:
            return F.embedding(input_ids, self.embed_tokens)
        return self._target.embed(input_ids)

    def feature_logit_hidden(self, feature: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, H]
        """The ``logit_hidden`` of :meth:`forward` from its ``next_feature`` (EAGLE-1: the
        same tensor; EAGLE-3: its final norm), so that a structured-output round can take the
        root's top-K again under the grammar's mask from the state kept between rounds."""
        if self.algorithm == "eagle":
            return feature
        return self.kernels.rms_norm(feature, self.norm, self.eps)

    def compute_logits(self, logit_hidden: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, V_draft]
        """Logits over the head's vocabulary (fp32)."""
        return self._logits(logit_hidden).float()

    def _logits(self, logit_hidden: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, V_draft]
        """Logits in the linear's dtype: the head's own lm_head, else the target's."""
        if self.lm_head is not None:
            return linear(logit_hidden, self.lm_head)
        return self._target.lm_logits(logit_hidden)

    def topk(
        self, logit_hidden: torch.Tensor, k: int, bitmask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k of the head's softmax, ids mapped to the target vocabulary:
        (topk_p [n, k] fp32, topk_index [n, k] int64). ``bitmask`` [n, W] int32 over the
        head's own vocabulary (structured output): the tokens it allows only."""
        # The logits stay in the linear's dtype: softmax_topk reads them once, in fp32.
        logits = self._logits(logit_hidden)
        if bitmask is not None:
            self.kernels.apply_token_bitmask(logits, bitmask)
        return self.kernels.softmax_topk(logits, k, index_map=self.draft_to_target)

    def probs(self, logit_hidden: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, V_target] fp32
        """The head's distribution scattered onto the target vocabulary."""
        p = torch.softmax(self.compute_logits(logit_hidden), dim=-1)
        if self.draft_to_target is None:
            return p
        out = p.new_zeros(p.shape[0], self._target.config.vocab_size)
        return out.index_copy_(1, self.draft_to_target, p)
