"""A small language model of the target's tokenizer used as the draft ("standalone")."""

from __future__ import annotations

import torch


class StandaloneDraft(torch.nn.Module):
    """Adapts a CausalLM to the draft-head interface.

    Unlike an EAGLE head (which stores the pair (target feature p, token p+1) at position p), it
    stores token p at position p, exactly like the target; the worker therefore runs one draft
    forward over each round's root token before expanding the tree.
    """

    algorithm = "standalone"
    target_feature_size = 0
    aux_layer_ids: tuple[int, ...] = ()

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm
        self.config = lm.config

    def forward(self, input_ids, features, positions, attn, metadata):  # noqa: ARG002
        hidden, _ = self.lm(input_ids, positions, attn, metadata)
        return hidden, hidden

    def probs(self, logit_hidden: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, V]
        return torch.softmax(self.lm.compute_logits(logit_hidden).float(), dim=-1)

    def topk(
        self, logit_hidden: torch.Tensor, k: int, bitmask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_p [n, k] fp32, topk_index [n, k] int64); ``bitmask`` [n, W] int32: the
        tokens it allows only (structured output)."""
        if bitmask is None:
            return self.probs(logit_hidden).topk(k, dim=-1)
        logits = self.lm.compute_logits(logit_hidden).float()
        self.lm.kernels.apply_token_bitmask(logits, bitmask)
        return torch.softmax(logits, dim=-1).topk(k, dim=-1)
