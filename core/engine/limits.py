"""What an engine's settings cost, checked before any of it is allocated.

The KV pools (target and draft) and the request table are sized from the configuration; a
setting too large for the machine would otherwise grow the process until the operating
system kills it, with no message. :func:`check_kv_memory` estimates those bytes and refuses,
naming the setting, the bytes and what the device has free. :func:`cap_max_context` keeps
``max_context`` within the target's own context (its rotary tables end there).
"""

from __future__ import annotations

import dataclasses

import torch

from polyspec.config import EngineConfig
from polyspec.errors import ConfigError

# The share of the free memory the KV pools and tables may take: the rest is left for the
# activations of a forward, captured graphs and the allocator's slack.
MEMORY_FRACTION = 0.9


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def kv_bytes_per_slot(model_configs, dtype: torch.dtype) -> int:
    """K and V of one token position in every layer of every model."""
    size = torch.empty((), dtype=dtype).element_size()
    return sum(2 * c.num_layers * c.num_kv_heads * c.head_dim * size for c in model_configs)


def check_kv_memory(
    config: EngineConfig,
    num_slots: int,
    model_configs,
    dtype: torch.dtype,
    index_dtype: torch.dtype,
    memory_info: tuple[int, int],
    device_name: str,
) -> None:
    """Refuse (ConfigError) a KV pool and request table that would not fit
    ``MEMORY_FRACTION`` of the free memory. ``memory_info``: (free, total) bytes, (0, 0) when
    the backend cannot tell (then nothing is checked)."""
    free, total = memory_info
    if free <= 0:
        return
    per_slot = kv_bytes_per_slot(model_configs, dtype)
    ps = config.page_size
    width = -(-config.max_context // ps) * ps
    table = config.max_batch_size * width * torch.empty((), dtype=index_dtype).element_size()
    need = num_slots * per_slot + table
    if need <= MEMORY_FRACTION * free:
        return
    if config.num_kv_slots is not None:
        source = f"num_kv_slots = {config.num_kv_slots}"
        fix = "lower num_kv_slots"
    else:
        source = (
            f"max_batch_size = {config.max_batch_size}, max_context = {config.max_context}, "
            f"page_size = {ps}"
        )
        fix = "lower max_batch_size, max_context or page_size, or set num_kv_slots"
    raise ConfigError(
        f"the KV cache would take {_bytes(need)} ({num_slots} slots x {_bytes(per_slot)} from "
        f"{source}) but {device_name} has {_bytes(free)} free of {_bytes(total)}; {fix}"
    )


def cap_max_context(config: EngineConfig, model_context: int | None) -> tuple[EngineConfig, str]:
    """``config`` with ``max_context`` at most the target's ``model_context`` (its
    ``max_position_embeddings``), and a note saying so ("" when unchanged)."""
    if not model_context or config.max_context <= model_context:
        return config, ""
    note = (
        f"max_context = {config.max_context} is more than the target's own context "
        f"({model_context} positions, max_position_embeddings): capped to {model_context}"
    )
    return dataclasses.replace(config, max_context=model_context), note
