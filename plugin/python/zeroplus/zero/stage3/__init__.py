"""ZeRO stage 3: parameters sharded too, gathered unit by unit around forward and backward.

    sharded_params.py    the stage-3 placement (ShardedParams): buckets, shards, publish, offload_param
    units.py             which submodules form a gather unit, and which parameters each needs
    param_gatherer.py    gather before use, release after, prefetch ahead
    gather_agreement.py  the ranks agree on every unit gather (rank-divergent execution fails fast)
    compile_boundary.py  the gatherer's hooks as torch.compile sees them: opaque calls
    sharded_init.py      zeroplus.init_context(): build a model without holding it whole
    deferred.py          the meta parameters init_context builds, their values kept as shards
    materialize.py       real storage for a meta-built model, one unit at a time
    heap.py              freed heap memory handed back to the OS while a model is built

The engine core (engine.py and its collaborators in the package above) is shared by the three
stages; stages.py composes Stage3Optimizer from it and ShardedParams.
"""
