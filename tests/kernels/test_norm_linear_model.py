"""A target whose backend folds each decoder layer's RMSNorm into the projection after it
(``Backend.norm_linear_fn``, the cuda backend's Triton ``rms_norm_linear``): the model calls
it for q/k/v and gate/up, an EAGLE-3 head still reads the layers' residual stream, and the
outputs are those of the unfused model. Run here on the cpu backend with the Triton kernel in
the interpreter (conftest)."""

from __future__ import annotations

import dataclasses

import torch

from polyspec import LLM, SamplingParams, SpeculativeConfig
from polyspec.backends.cpu.backend import CPUBackend
from polyspec.kernels.triton.linear import rms_norm_linear
from polyspec.model.config import ModelConfig
from polyspec.model.eagle import DraftHead
from polyspec.model.llama import CausalLM
from polyspec.model.loader import default_aux_layers

CONFIG = ModelConfig(
    architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=3,
    num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256, eos_token_ids=(2,),
).validate()  # fmt: skip


class FusedNormCPU(CPUBackend):
    """The cpu backend, its norms folded into the projections by the Triton kernel; counts
    the fused calls."""

    def __init__(self) -> None:
        super().__init__()
        self.fused_calls = 0

    def norm_linear_fn(self, weight, norm_weight, eps):  # weight [out, in], norm [in]
        def fn(x, residual, bias):
            self.fused_calls += 1
            return rms_norm_linear(x, residual, norm_weight, eps, weight, bias)

        return fn


@torch.no_grad()
def _models(backend) -> tuple[CausalLM, DraftHead]:
    """Peaked random weights (no greedy near-ties), the same on every backend."""
    target = CausalLM(CONFIG, backend.kernels, backend.device(), torch.float32)
    head = DraftHead(
        "eagle3", dataclasses.replace(CONFIG, num_layers=1), target, backend.kernels,
        backend.device(), torch.float32, draft_vocab_size=64,
        aux_layer_ids=default_aux_layers(CONFIG.num_layers),
    )  # fmt: skip
    head.set_token_map(torch.arange(0, 128, 2))
    g = torch.Generator().manual_seed(0)
    for module in (target, head):
        for name, p in module.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif leaf in ("embed_tokens", "lm_head"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(p.shape[1] ** -0.5 * torch.randn(p.shape, generator=g))
    return target.eval(), head.eval()


def test_fused_norms_give_the_unfused_models_outputs():
    plain_be, fused_be = CPUBackend(), FusedNormCPU()
    prompts = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(1)).tolist()
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    spec = SpeculativeConfig(algorithm="eagle3", num_steps=2, topk=1)
    kw = dict(max_batch_size=2, max_context=64, graphs="off")

    def run(be, speculative):
        target, head = _models(be)
        llm = LLM.from_modules(target, head if speculative else None, speculative, backend=be, **kw)
        return [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp)]

    want = run(plain_be, None)
    assert run(fused_be, None) == want
    calls = fused_be.fused_calls
    assert calls >= 2 * CONFIG.num_layers  # every layer's two norms, in every forward
    assert run(fused_be, spec) == want  # the head reads the residual stream the fused calls return
    assert fused_be.fused_calls > calls
