"""The one check of tests/README.md's rule "a stage-3 test shards": which parameters a stage-3
engine really holds sharded on this rank.

Stage 3 keeps every parameter of at most param_persistence_threshold elements (default 100,000)
whole on every rank, so a toy model at the default threshold is not sharded at all and a
"stage-3" test of it tests stage 2. A test lowers the threshold (SHARD_ALL: 0) and calls
assert_sharded on every rank between steps, for the parameters it means to test.

A parameter is sharded on this rank when
  * it lives in a stage-3 bucket that is not persistent (frozen parameters' buckets included),
  * this rank holds at most its piece of it between uses (the module sees a resting view: the
    full shape with no values, zeroplus.zero.layout.resting_view; the piece is in the bucket's
    shard, or on disk when the parameter store keeps it there), never the full tensor,
  * and the group is split: some rank's piece is smaller than the parameter (at world size 1
    the one shard is the whole bucket, which shards nothing).
A parameter that lies wholly inside another rank's shard is sharded on this rank (it holds none
of it); one that lies wholly inside this rank's shard is still sharded (the others hold none).
"""

from __future__ import annotations

# ds_config fragment of a stage-3 test: every parameter, however small, sharded
SHARD_ALL = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}


def engine_of(opt):
    """The zeroplus engine behind a framework's optimizer wrapper (accelerate's
    AcceleratedOptimizer, Lightning's LightningOptimizer: `.optimizer`), or None."""
    seen = 0
    while opt is not None and seen < 8:
        if hasattr(opt, "placement") and hasattr(opt, "stage"):
            return opt
        opt = getattr(opt, "optimizer", None) or getattr(opt, "_optimizer", None)
        seen += 1
    return None


def _buckets(engine):
    return list(getattr(engine, "buckets", [])) + list(getattr(engine.placement, "frozen_buckets", []))


def _held_numel(p) -> int:
    """The elements p's own .data holds: none for a resting view."""
    from zeroplus.zero.dtensor_params import local
    from zeroplus.zero.layout import is_resting

    t = local(p)
    return 0 if is_resting(t.data) else t.numel()


def nonpersistent_names(model, opt) -> list[str]:
    """The parameters of `model` in the stage-3 engine's non-persistent buckets (trainable and
    frozen), sorted; [] for any other optimizer. The kind of bucket a checkpoint saves and loads as
    shards, also at world size 1 (checkpoint_models.sharded_names): not yet a proof that this rank
    holds less than the whole parameter (sharded_names)."""
    engine = engine_of(opt)
    if engine is None or engine.stage != 3:
        return []
    name_of = {id(p): n for n, p in model.named_parameters()}
    return sorted(name_of[id(e.param)] for b in _buckets(engine) if not b.persistent for e in b.entries)


def sharded_names(model, opt) -> list[str]:
    """The parameters of `model` (trainable and frozen, a tied one under its first name) that the
    stage-3 engine behind `opt` holds sharded on this rank (module docstring), sorted; [] for any
    other optimizer or stage. Call it between steps (not inside forward or backward)."""
    engine = engine_of(opt)
    if engine is None or engine.stage != 3 or engine.world_size < 2:
        return []
    rank, world = engine.rank, engine.world_size
    where = {}
    for b in _buckets(engine):
        for e in b.entries:
            where[id(e.param)] = (b, e)
    out = []
    for name, p in model.named_parameters():
        b, e = where.get(id(p), (None, None))
        if b is None or b.persistent or b.flat is not None:  # kept whole, or gathered right now
            continue
        own = b.piece(e, rank).numel
        if _held_numel(p) > own:  # this rank holds more of it than its piece
            continue
        if min(b.piece(e, r).numel for r in range(world)) < e.numel:
            out.append(name)
    return sorted(out)


def assert_sharded(model, opt, names=None, *, at_least: int = 1) -> list[str]:
    """Raise AssertionError (naming this rank and the parameters) unless every parameter of
    `names` (default: every parameter of `model`) is sharded on this rank and at least `at_least`
    are; returns the sorted names checked. Run it on every rank."""
    engine = engine_of(opt)
    rank = getattr(engine, "rank", "?")
    if engine is None or engine.stage != 3:
        raise AssertionError(f"rank {rank}: {type(opt).__name__} is not a stage-3 zeroplus engine")
    wanted = sorted(n for n, _ in model.named_parameters()) if names is None else sorted(names)
    have = set(sharded_names(model, opt))
    whole = [n for n in wanted if n not in have]
    if whole:
        raise AssertionError(f"rank {rank}: not sharded (kept whole, world size {engine.world_size}, "
                             f"param_persistence_threshold {engine.placement.policy.param_persistence_threshold}): "
                             f"{whole}")
    if len(wanted) < at_least:
        raise AssertionError(f"rank {rank}: {len(wanted)} sharded parameters, expected at least {at_least}")
    return wanted
