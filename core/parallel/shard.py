"""Which rank holds which part of a Llama-family decoder (Megatron-style tensor parallelism).

Of ``W`` ranks, rank ``r`` holds query heads ``[r * Hq/W, (r+1) * Hq/W)``, the matching rows of
q/k/v (column parallel) and columns of o_proj (row parallel); intermediate rows
``[r * I/W, ...)`` of gate/up and the same columns of down_proj; vocabulary rows
``[r * V/W, ...)`` of the embedding and the lm_head. Key/value heads are split the same way
when ``W`` divides ``Hkv``; with fewer key/value heads than ranks (``W`` a multiple of ``Hkv``)
each rank holds the one key/value head its query heads read, so ``W / Hkv`` ranks hold copies
of each. Everything else (norms, biases of row-parallel layers) is replicated.
"""

from __future__ import annotations

import dataclasses

from polyspec.errors import ConfigError


def _range(rank: int, world: int, n: int) -> tuple[int, int]:
    per = n // world
    return rank * per, (rank + 1) * per


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """The part of one model that rank ``rank`` of ``world_size`` holds (global index ranges,
    ``[start, stop)``)."""

    rank: int
    world_size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]

    @classmethod
    def of(
        cls,
        rank: int,
        world_size: int,
        num_heads: int,
        num_kv_heads: int,
        intermediate_size: int,
        vocab_size: int,
    ) -> ShardLayout:
        """The layout of rank ``rank``; the sizes must pass :func:`check_shardable`."""
        check_shardable(world_size, num_heads, num_kv_heads, intermediate_size, vocab_size)
        if num_kv_heads % world_size == 0:
            kv = _range(rank, world_size, num_kv_heads)
        else:  # fewer key/value heads than ranks: W / Hkv ranks share (a copy of) each
            head = rank // (world_size // num_kv_heads)
            kv = (head, head + 1)
        return cls(
            rank=rank,
            world_size=world_size,
            q_heads=_range(rank, world_size, num_heads),
            kv_heads=kv,
            intermediate=_range(rank, world_size, intermediate_size),
            vocab=_range(rank, world_size, vocab_size),
        )

    @property
    def num_heads(self) -> int:
        """Query heads on this rank."""
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        """Key/value heads on this rank."""
        return self.kv_heads[1] - self.kv_heads[0]


def allowed_sizes(
    num_heads: int, num_kv_heads: int, intermediate_size: int, vocab_size: int, limit: int = 64
) -> list[int]:
    """The tensor-parallel sizes up to ``limit`` a model of these shapes can be split into."""
    out = []
    for w in range(1, limit + 1):
        if (
            num_heads % w == 0
            and intermediate_size % w == 0
            and vocab_size % w == 0
            and (num_kv_heads % w == 0 or w % num_kv_heads == 0)
        ):
            out.append(w)
    return out


def check_shardable(
    world_size: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    vocab_size: int,
    what: str = "the target",
) -> None:
    """Raise :class:`ConfigError` naming every number ``world_size`` does not divide and the
    sizes that would work, so that a bad size is refused before any weight is read."""
    if world_size < 1:
        raise ConfigError(f"tensor_parallel_size = {world_size} is invalid: a positive integer")
    if world_size == 1:
        return
    bad = []
    if num_heads % world_size:
        bad.append(f"{num_heads} attention heads")
    if num_kv_heads % world_size and world_size % num_kv_heads:
        bad.append(
            f"{num_kv_heads} key/value heads (the size must divide them, or be a multiple of them)"
        )
    if intermediate_size % world_size:
        bad.append(f"an MLP width of {intermediate_size}")
    if vocab_size % world_size:
        bad.append(f"a vocabulary of {vocab_size}")
    if bad:
        ok = allowed_sizes(num_heads, num_kv_heads, intermediate_size, vocab_size)
        raise ConfigError(
            f"tensor_parallel_size = {world_size} does not divide {what}'s "
            + ", ".join(bad)
            + f"; sizes this model allows: {', '.join(map(str, ok))}"
        )
