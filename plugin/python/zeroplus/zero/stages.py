"""The three ZeRO stages as optimizer classes: one engine (engine.py), composed differently.

    Stage1Optimizer  gradients all-reduced and kept whole; master + optimizer state sharded
    Stage2Optimizer  gradients reduce-scattered too (each rank keeps its shard only)
    Stage3Optimizer  parameters sharded too, gathered unit by unit around forward and backward

A stage class only chooses the parameter placement (replicated_params.py or sharded_params.py)
and whether gradients are sharded (the reducer's mode, from `stage`); everything else is the
engine's. zeroplus.initialize(stage=N) returns these; ZeroRedundancyOptimizer(stage=2) too,
through engine_for_stage (the one lookup from a stage to its engine for params without a model).
"""

from __future__ import annotations

import functools

from ..offload.policy import parse_offload
from .engine import ZeroEngine
from .policies import EngineOptions, PrecisionPolicy
from .replicated_params import ReplicatedParams
from .stage3.sharded_params import ShardedParams


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


def _engine_from_params(engine, params, optimizer_class, *, process_group=None, mixed_precision=None,
                        reduce_bucket_elems=None, offload_optimizer=None, offload_param=None, **defaults):
    """ZeroRedundancyOptimizer(params, ..., stage=2), or stage 1 over tensor-parallel (DTensor)
    parameters: its extra keywords become the policies (offload_optimizer as zeroplus.initialize
    takes it; offload_param is stage 3's, which ZeroRedundancyOptimizer does not build)."""
    if offload_param is not None:
        raise ValueError("ZeroRedundancyOptimizer: offload_param applies to ZeRO stage 3 only (parameters are "
                         "sharded there): use zeroplus.initialize(model, ..., stage=3, offload_param=...)")
    try:
        extra = {} if reduce_bucket_elems is None else {"reduce_bucket_elems": reduce_bucket_elems}
        if offload_optimizer is not None:
            extra["offload_optimizer"] = parse_offload("offload_optimizer", offload_optimizer)
        options = EngineOptions(precision=PrecisionPolicy(mixed_precision=mixed_precision), **extra)
    except (TypeError, ValueError) as e:
        raise type(e)(f"ZeroRedundancyOptimizer: {e}") from e
    return engine(params, optimizer_class, options=options, process_group=process_group, **defaults)


def engine_for_stage(stage: int):
    """The factory `ZeroRedundancyOptimizer(params, cls, ..., stage=N)` builds its engine with
    (stage 2, or stage 1 over tensor-parallel params): `factory(params, cls, process_group=...,
    **keywords)`. Stage 3 needs the model (zeroplus.initialize), so it has no such factory."""
    engines = {1: Stage1Optimizer, 2: Stage2Optimizer}
    if stage not in engines:
        raise ValueError(f"engine_for_stage: stage must be 1 or 2 (stage 3 needs the model), got {stage!r}")
    return functools.partial(_engine_from_params, engines[stage])
