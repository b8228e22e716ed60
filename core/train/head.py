"""A trainable EAGLE-3 head with the training-time test (TTT) of the EAGLE-3 paper.

Parameter names are those of the SpecForge / SGLang checkpoint format, so ``state_dict()`` is
the file we ship. The math is the inference head's (``polyspec.model.eagle.DraftHead``), in
batched ``[B, T]`` form; ``tests/core/test_train.py`` checks the two agree.

TTT: at inference, draft step j at position p reads the token p+1 and the *draft's own*
output of step j-1 at position p-1, and attends to step-0 keys up to p-j plus one key from each
later step. Training unrolls exactly that for ``ttt_steps`` steps, so the head learns from its
own (imperfect) features instead of always the target's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from polyspec.model.rope import cos_sin_cache


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [B, heads, T, D]; neox layout (rotate halves), as Llama checkpoints use
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, p - n] at position p (zeros for p < n); x [B, ..., T, ...] with T at dim 1."""
    if n == 0:
        return x
    return torch.cat([torch.zeros_like(x[:, :n]), x[:, :-n]], dim=1)


class _MidLayer(nn.Module):
    def __init__(self, h: int, inter: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(2 * h, heads * head_dim, bias=False)
        self.self_attn.k_proj = nn.Linear(2 * h, kv_heads * head_dim, bias=False)
        self.self_attn.v_proj = nn.Linear(2 * h, kv_heads * head_dim, bias=False)
        self.self_attn.o_proj = nn.Linear(heads * head_dim, h, bias=False)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(h, inter, bias=False)
        self.mlp.up_proj = nn.Linear(h, inter, bias=False)
        self.mlp.down_proj = nn.Linear(inter, h, bias=False)
        self.input_layernorm = nn.Module()
        self.input_layernorm.weight = nn.Parameter(torch.ones(h))
        self.hidden_norm = nn.Module()
        self.hidden_norm.weight = nn.Parameter(torch.ones(h))
        self.post_attention_layernorm = nn.Module()
        self.post_attention_layernorm.weight = nn.Parameter(torch.ones(h))


class Eagle3Trainable(nn.Module):
    """fc (3H -> H), one midlayer with 2H-input attention, norm, draft-vocab lm_head."""

    def __init__(self, target_config, draft_vocab_size: int, max_positions: int):
        super().__init__()
        c = target_config
        self.cfg = c
        self.h, self.heads, self.kv_heads, self.head_dim = (
            c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        )  # fmt: skip
        self.eps = c.rms_norm_eps
        self.fc = nn.Linear(3 * c.hidden_size, c.hidden_size, bias=False)
        self.midlayer = _MidLayer(
            c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim
        )
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(c.hidden_size))
        self.lm_head = nn.Linear(c.hidden_size, draft_vocab_size, bias=False)
        cs = cos_sin_cache(c.head_dim, max_positions, c.rope_theta, c.rope_scaling)
        self.register_buffer("cos_sin", cs, persistent=False)

    @torch.no_grad()
    def init_from_target(self, target, draft_ids: torch.Tensor) -> None:
        """Warm start: lm_head rows and final norm from the target, the midlayer's MLP, o_proj
        and norms from the target's last layer, fc averaging the three aux features."""
        h = self.h
        self.lm_head.weight.copy_(
            target.lm_head_weight[draft_ids.to(target.lm_head_weight.device)].float()
        )
        self.norm.weight.copy_(target.norm.float())
        last = target.layers[-1]
        m = self.midlayer
        inter = last.down_proj.shape[1]
        m.mlp.gate_proj.weight.copy_(last.gate_up_proj[:inter].float())
        m.mlp.up_proj.weight.copy_(last.gate_up_proj[inter:].float())
        m.mlp.down_proj.weight.copy_(last.down_proj.float())
        m.self_attn.o_proj.weight.copy_(last.o_proj.float())
        qs, kvs = last.q_size, last.kv_size
        w = last.qkv_proj.float()
        for proj, rows in ((m.self_attn.q_proj, w[:qs]), (m.self_attn.k_proj, w[qs : qs + kvs]),
                           (m.self_attn.v_proj, w[qs + kvs :])):  # fmt: skip
            proj.weight.copy_(torch.cat([rows, rows], dim=1) * 0.5)
        m.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.float())
        m.input_layernorm.weight.copy_(last.input_layernorm.float())
        m.hidden_norm.weight.copy_(last.input_layernorm.float())
        eye = torch.eye(h) / 3
        self.fc.weight.copy_(torch.cat([eye, eye, eye], dim=1))

    def forward(
        self,
        aux: torch.Tensor,  # [B, T, 3H] target features at each position
        next_embeds: torch.Tensor,  # [B, T, H] embedding of the token at position p + 1
        ttt_steps: int,
    ) -> list[torch.Tensor]:  # ttt_steps x [B, T, V_draft] logits
        """Logits of each TTT step; step j at position p is valid for p >= j."""
        bsz, t, _ = aux.shape
        m, a = self.midlayer, self.midlayer.self_attn
        cos, sin = self.cos_sin[:t].chunk(2, dim=-1)
        e = _rms(next_embeds, m.input_layernorm.weight, self.eps)
        feat = self.fc(aux)
        rep = self.heads // self.kv_heads
        full = torch.ones(t, t, dtype=torch.bool, device=aux.device)
        keys, values, logits = [], [], []
        pre = feat
        for j in range(ttt_steps):
            if j > 0:  # the previous step's output at position p - 1
                feat = _shift(pre, 1)
            x = torch.cat([e, _rms(feat, m.hidden_norm.weight, self.eps)], dim=-1)
            q = a.q_proj(x).view(bsz, t, self.heads, self.head_dim).transpose(1, 2)
            k = a.k_proj(x).view(bsz, t, self.kv_heads, self.head_dim).transpose(1, 2)
            v = a.v_proj(x).view(bsz, t, self.kv_heads, self.head_dim).transpose(1, 2)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            keys.append(k)
            values.append(v)
            scale = self.head_dim**-0.5
            # step-0 keys up to position p - j
            s0 = (q @ keys[0].transpose(-1, -2)) * scale
            s0 = s0.masked_fill(~full.tril(-j), float("-inf"))
            # one key from each later step i at position p - j + i ("the diagonal")
            diag_k = [
                _shift(keys[i].transpose(1, 2), j - i).transpose(1, 2) for i in range(1, j + 1)
            ]
            diag_v = [
                _shift(values[i].transpose(1, 2), j - i).transpose(1, 2) for i in range(1, j + 1)
            ]
            sd = [(q * dk).sum(-1, keepdim=True) * scale for dk in diag_k]
            probs = torch.softmax(torch.cat([s0] + sd, dim=-1).float(), dim=-1).to(q.dtype)
            o = probs[..., :t] @ values[0]
            for i, dv in enumerate(diag_v):
                o = o + probs[..., t + i : t + i + 1] * dv
            o = a.o_proj(o.transpose(1, 2).reshape(bsz, t, -1))
            resid = o + feat
            x2 = _rms(resid, m.post_attention_layernorm.weight, self.eps)
            mlp = m.mlp.down_proj(F.silu(m.mlp.gate_proj(x2)) * m.mlp.up_proj(x2))
            pre = mlp + resid
            logits.append(self.lm_head(_rms(pre, self.norm.weight, self.eps)))
        return logits
