"""Tensor parallelism: the group of ranks that forms one worker and its collectives, each
with a deadline."""

from common.parallel.group import GroupLost, TpGroup, even_range, shard_range

__all__ = ["GroupLost", "TpGroup", "even_range", "shard_range"]
