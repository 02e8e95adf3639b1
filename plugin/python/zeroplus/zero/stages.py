"""The three ZeRO stages as optimizer classes: one engine (engine.py), composed differently.

    Stage1Optimizer  gradients all-reduced and kept whole; master + optimizer state sharded
    Stage2Optimizer  gradients reduce-scattered too (each rank keeps its shard only)
    Stage3Optimizer  parameters sharded too, gathered unit by unit around forward and backward

A stage class only chooses the parameter placement (replicated_params.py or sharded_params.py)
and whether gradients are sharded (the reducer's mode, from `stage`); everything else is the
engine's. zeroplus.initialize(stage=N) returns these; ZeroRedundancyOptimizer(stage=2) too.
"""

from __future__ import annotations

from .engine import ZeroEngine
from .policies import EngineOptions
from .replicated_params import ReplicatedParams
from .sharded_params import ShardedParams


class Stage1Optimizer(ZeroEngine):
    """ZeRO stage 1: gradients are all-reduced and kept whole, the fp32 master and optimizer state
    are sharded. zeroplus.initialize(stage=1) returns it at every precision
    (zeroplus.ZeroRedundancyOptimizer is torch's interface, for a user's own DDP model)."""

    stage = 1

    def _make_placement(self, options: EngineOptions):
        return ReplicatedParams(self)


class Stage2Optimizer(ZeroEngine):
    """ZeRO stage 2: gradients reduce-scattered during backward, optimizer state sharded."""

    stage = 2

    def _make_placement(self, options: EngineOptions):
        return ReplicatedParams(self)


class Stage3Optimizer(ZeroEngine):
    """ZeRO stage 3: parameters sharded as well (options.stage3 says how they are gathered)."""

    stage = 3

    def _make_placement(self, options: EngineOptions):
        return ShardedParams(self, options.stage3)

    @property
    def gatherer(self):
        """The parameter gatherer (param_gatherer.py): units' residency, prefetch statistics."""
        return self.placement.gatherer

    @property
    def units(self):
        return self.placement.units
