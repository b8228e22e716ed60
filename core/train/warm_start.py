"""Warm start from a trained EAGLE-3 head (``train-draft --init-from``): its weights and its
draft vocabulary, so that training can go on over new answers across several runs."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from polyspec.errors import ConfigError


def load_trained_head(
    head_dir: str | Path, target_config, aux_capture_layers: tuple[int, ...]
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(float32 state dict for :class:`~polyspec.train.head.Eagle3Trainable`, sorted target ids
    of the head's draft vocabulary [V_draft]) from a head written by ``train-draft`` (or any
    SpecForge-format EAGLE-3 head of the same shape). Raises ConfigError, naming the field,
    when the head does not fit the target."""
    from safetensors.torch import load_file

    d = Path(head_dir)
    cfg_file, weights = d / "config.json", d / "model.safetensors"
    if not cfg_file.is_file() or not weights.is_file():
        raise ConfigError(
            f"--init-from {d}: expected an EAGLE-3 head directory with config.json and "
            "model.safetensors (the --out of an earlier train-draft run)"
        )
    cfg = json.loads(cfg_file.read_text())
    c = target_config
    want = {"hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
            "head_dim": c.head_dim, "vocab_size": c.vocab_size}  # fmt: skip
    for key, value in want.items():
        if key in cfg and cfg[key] != value:
            raise ConfigError(
                f"--init-from {d}: the head's {key} is {cfg[key]}, the target's {value}; "
                "warm-start from a head trained for this target"
            )
    aux = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if aux is not None and [i + 1 for i in aux] != list(aux_capture_layers):
        raise ConfigError(
            f"--init-from {d}: the head reads layer outputs {aux}, training captures "
            f"{[i - 1 for i in aux_capture_layers]}; the head was trained with other layers"
        )
    sd = load_file(str(weights))
    if "t2d" not in sd or "d2t" not in sd:
        raise ConfigError(f"--init-from {d}: model.safetensors has no d2t / t2d vocabulary maps")
    t2d, d2t = sd.pop("t2d").bool(), sd.pop("d2t").long()
    draft_ids = torch.nonzero(t2d).flatten()
    if draft_ids.numel() != d2t.numel() or not torch.equal(
        draft_ids, d2t + torch.arange(d2t.numel())
    ):
        raise ConfigError(f"--init-from {d}: d2t and t2d disagree; the head file is damaged")
    return {k: v.float() for k, v in sd.items()}, draft_ids


def grow_lm_head(
    state: dict[str, torch.Tensor],  # a trained head's state dict (load_trained_head)
    old_ids: torch.Tensor,  # [V_old] its draft vocabulary, sorted target ids
    new_ids: torch.Tensor,  # [V_new] a sorted superset of old_ids
    target_lm_head: torch.Tensor,  # [V_target, H] the target's output embedding
) -> dict[str, torch.Tensor]:
    """The state dict for the larger draft vocabulary ``new_ids``: the trained lm_head rows
    where an id was already drafted, the target's own rows for the added ids (the same warm
    start a new head gets), every other tensor unchanged."""
    pos = torch.searchsorted(new_ids, old_ids)
    if pos.max() >= new_ids.numel() or not torch.equal(new_ids[pos], old_ids):
        raise ValueError("the new draft vocabulary must contain the old one")
    rows = target_lm_head[new_ids.to(target_lm_head.device)].float().cpu()
    rows[pos] = state["lm_head.weight"].float()
    return {**state, "lm_head.weight": rows}
