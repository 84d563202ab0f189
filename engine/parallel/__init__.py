"""Tensor parallelism: the group and its collectives (`group`), how weights split per rank (`shard`)."""

from specstep.engine.parallel.group import SINGLE, ParallelConfig, TPGroup, init_tp_group

__all__ = ["SINGLE", "ParallelConfig", "TPGroup", "init_tp_group"]
