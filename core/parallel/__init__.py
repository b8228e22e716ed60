"""Tensor parallelism over ``torch.distributed`` (docs/distributed.md).

:mod:`.group` is the ranks' view of each other (collectives, the command channel, failure
reports); :mod:`.shard` the arithmetic of which rank holds which heads, columns and vocabulary
rows; :mod:`.launch` starts the ranks (spawned by rank 0, or under ``torchrun``). This layer
sits below the model: the models call its collectives, the engine its launch.
"""

from polyspec.parallel.group import TPGroup
from polyspec.parallel.shard import ShardLayout, check_shardable

__all__ = ["ShardLayout", "TPGroup", "check_shardable"]
