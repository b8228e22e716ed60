"""One model with its own KV pool and attention, run over ForwardBatches."""

from __future__ import annotations

import torch

from polyspec.backend import Backend, ForwardBatch


class ModelRunner:
    """Runs a target model, an EAGLE head or a standalone draft through the backend.

    Target and draft each own a KV pool, indexed by the shared slot space.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        backend: Backend,
        num_slots: int,
        dtype: torch.dtype,
        capture_layers: tuple[int, ...] = (),
    ):
        cfg = model.config
        self.model = model
        self.backend = backend
        self.capture_layers = capture_layers
        # A tensor-parallel rank's target holds some of the heads (CausalLM.local_heads).
        heads, kv_heads = getattr(model, "local_heads", (cfg.num_heads, cfg.num_kv_heads))
        self.kv_pool = backend.make_kv_pool(
            num_slots, cfg.num_layers, kv_heads, cfg.head_dim, dtype
        )
        self.attn = backend.make_attention(
            self.kv_pool, heads, kv_heads, cfg.head_dim, cfg.attn_scale
        )

    def _metadata(self, batch: ForwardBatch, static_prefix: int | None):
        if static_prefix is None:
            return self.attn.build_metadata(batch)
        return self.attn.build_static_metadata(batch, static_prefix)

    @torch.inference_mode()
    def forward_target(
        self, batch: ForwardBatch, static_prefix: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (final normed hidden [T, H], captured aux hidden [T, A*H] or None).

        ``static_prefix``: a captured forward (see ``AttentionBackend.build_static_metadata``)
        whose prefixes are at most this long."""
        metadata = self._metadata(batch, static_prefix)
        return self.model(
            batch.input_ids, batch.positions, self.attn, metadata, self.capture_layers
        )

    @torch.inference_mode()
    def forward_draft(
        self,
        batch: ForwardBatch,
        features: torch.Tensor,  # [T, F]
        static_prefix: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (logit hidden [T, H], next feature [T, H])."""
        metadata = self._metadata(batch, static_prefix)
        return self.model(batch.input_ids, features, batch.positions, self.attn, metadata)
