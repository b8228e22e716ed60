"""Write a trained head in the EAGLE-3 format SpecForge and SGLang read."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from polyspec.train.head import Eagle3Trainable
from polyspec.train.vocab import d2t_t2d


def export_eagle3(
    head: Eagle3Trainable,
    draft_ids: torch.Tensor,  # [V_draft] sorted target ids
    aux_capture_layers: tuple[int, ...],  # our convention: inputs of these layers
    out_dir: Path,
    dtype: torch.dtype = torch.bfloat16,
) -> None:
    """config.json + model.safetensors (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``,
    ``t2d``). Files are written under temporary names and renamed, so an interrupted export
    never leaves a half-written head."""
    c = head.cfg
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": int(draft_ids.numel()),
        "target_hidden_size": c.hidden_size,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        # checkpoint convention: "output of layer i" = the input of layer i + 1 we capture
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux_capture_layers]},
    }
    sd = {k: v.detach().to("cpu", dtype).contiguous() for k, v in head.state_dict().items()}
    d2t, t2d = d2t_t2d(draft_ids.cpu(), c.vocab_size)
    sd["d2t"], sd["t2d"] = d2t, t2d
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp_w, tmp_c = out_dir / "model.safetensors.tmp", out_dir / "config.json.tmp"
    save_file(sd, str(tmp_w), metadata={"format": "pt"})
    tmp_c.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(tmp_w, out_dir / "model.safetensors")
    os.replace(tmp_c, out_dir / "config.json")
