"""zeroplus.checkpoint.get_state_dict / set_state_dict: zeroplus's state through torch.distributed.checkpoint.

Three launches (2, 1 and 3 ranks) of one small model (CkptNet: a tied embedding/head, a frozen
parameter, a buffer):
  * at 2 ranks, each SAVES case trains 3 steps at stage s (fp32, bf16, ZeroRedundancyOptimizer),
    dcp.saves get_state_dict's dicts (through AioStorageWriter or torch's FileSystemWriter) and
    keeps the same state in memory (full parameters + the consolidated optimizer state);
  * at 1 and at 3 ranks, each LOADS case builds a fresh model at stage t (other seed, other lr;
    some trained a step first, WARM),
    get_state_dict + dcp.load + set_state_dict (A), and the same fresh model given the in-memory
    state (B): right after the load A's parameters and consolidated optimizer state equal the
    saved ones exactly (hyperparameters included: lr comes back), and after one training step
    A equals B bit for bit (fp32; to bf16 rounding in bf16). Every stage is saved and loaded at
    least once at each world size;
  * at 2 ranks, interop both ways with torch's own get_state_dict/set_state_dict on a plain
    nn.Module + torch.optim.AdamW, and the errors: dcp.load into a mismatched model (shape
    mismatch, a key the checkpoint lacks) and set_state_dict with a mismatched dict (missing
    key, shape mismatch, unknown optimizer entry) raise naming the key, with model and optimizer
    untouched; bad arguments raise naming them.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import checkpoint_models as cm
from checkpoint_helpers import optimizer_state_diffs
from harness import run_cases_in_own_groups, run_pooled

# name -> (save kind/stage, precision, storage); loads: (name, load kind/stage) per world size
SAVES = {
    "s1": (1, None, "aio"),
    "s2": (2, None, "torch"),
    "s3": (3, None, "aio"),
    "s2bf16": (2, "bf16", "aio"),
    "s1fp16": (1, "fp16", "torch"),
    "zro": ("zro", None, "torch"),
}
LOADS = {
    1: [("s1", 2), ("s2", 3), ("s3", 1), ("zro", 2)],
    3: [("s1", 3), ("s2", 1), ("s3", "zro"), ("s3", 2), ("s2bf16", 3), ("s1fp16", 2)],
}
# loads into a model that trained a step first: the dicts view live optimizer state, not new zeros
WARM = {(1, "s3", 1), (3, "s2", 1), (3, "s3", "zro")}


def _split(stage):
    return ("zro", 1) if stage == "zro" else ("engine", stage)


def _build(kind, stage, precision, group, seed, lr=1e-2, model=None, persist=0):
    """checkpoint_models.build, but stage 3 keeps only parameters of at most `persist` elements
    whole on every rank (the default threshold, 1e5, would keep all of this small model whole:
    0 shards every parameter, the frozen one included; 8 keeps the frozen one and lin2.bias whole)."""
    if kind != "engine" or stage != 3:
        return cm.build(kind, stage, precision, group, seed, lr=lr, model=model)
    import zeroplus

    model = cm.make(seed) if model is None else model
    config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": persist}}
    model, opt = zeroplus.initialize(model, torch.optim.AdamW, lr=lr, weight_decay=0.1, mixed_precision=precision,
                                     process_group=group, config=config)
    return model, model, opt


def _writer(kind, path):
    import torch.distributed.checkpoint as dcp

    from zeroplus.checkpoint import AioStorageWriter

    return AioStorageWriter(path) if kind == "aio" else dcp.FileSystemWriter(path)


def _save_case(root, name, rank, group):
    import torch.distributed.checkpoint as dcp

    import zeroplus

    stage, precision, storage = SAVES[name]
    kind, stage = _split(stage)
    model, call, opt = _build(kind, stage, precision, group, seed=0)
    cm.train(call, opt, 3, rank)
    model_sd, optim_sd = zeroplus.checkpoint.get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=_writer(storage, os.path.join(root, name)),
             process_group=group)
    full = cm.full_params(kind, model)
    plain = cm.consolidated_optimizer(opt, rank)
    scaler = opt.scaler.state_dict() if precision == "fp16" else None  # fp16: the loss scale goes along
    if rank == 0:
        torch.save((full, plain, scaler), os.path.join(root, name + ".handover"))
    return True


def _save_all(rank, world, root):
    import functools

    return run_cases_in_own_groups(rank, world, {n: functools.partial(_save_case, root, n) for n in SAVES})


def _load_case(root, name, stage, rank, group):
    import torch.distributed.checkpoint as dcp

    import zeroplus
    from zeroplus.checkpoint import AioStorageReader

    import torch.distributed as dist

    precision = SAVES[name][1]
    load_stage = stage
    kind, stage = _split(stage)
    full, plain, scaler = torch.load(os.path.join(root, name + ".handover"), weights_only=False)
    model_a, call_a, opt_a = _build(kind, stage, precision, group, seed=1, lr=1e-3, persist=8)
    if (dist.get_world_size(group), name, load_stage) in WARM:
        cm.train(call_a, opt_a, 1, rank, first_step=20)
    model_sd, optim_sd = zeroplus.checkpoint.get_state_dict(model_a, opt_a)
    # the local shards per tensor (> 1: a flat range became several boxes)
    most_shards = max(len(v.local_shards()) for v in model_sd.values() if hasattr(v, "local_shards")) \
        if any(hasattr(v, "local_shards") for v in model_sd.values()) else 0
    masters = [m.clone() for m in getattr(opt_a, "masters", [])]
    dcp.load({"model": model_sd, "optim": optim_sd}, storage_reader=AioStorageReader(os.path.join(root, name)),
             process_group=group)
    # the model's shards are views of the masters, so dcp.load alone changed them
    homes = {m.untyped_storage().data_ptr() for m in getattr(opt_a, "masters", [])}
    views = all(s.tensor.untyped_storage().data_ptr() in homes for v in model_sd.values()
                if hasattr(v, "local_shards") for s in v.local_shards() if s.tensor.numel())
    in_place = (views and any(not torch.equal(a, b) for a, b in zip(masters, opt_a.masters))) if masters else None
    zeroplus.checkpoint.set_state_dict(model_a, opt_a, model_sd, optim_sd)
    out = {"most_shards": most_shards, "in_place": in_place}
    if scaler is not None:
        out["scaler_equal"] = opt_a.scaler.state_dict() == scaler
    loaded = cm.full_params(kind, model_a)
    out["params_differ"] = sorted(k for k in full if not torch.equal(full[k], loaded[k].to(full[k].dtype)))
    loaded_opt = cm.consolidated_optimizer(opt_a, rank)
    out["opt_diffs"] = optimizer_state_diffs(plain, loaded_opt) if rank == 0 else []
    fresh = cm.make(1)
    fresh.load_state_dict({k: v.float() for k, v in full.items()})
    model_b, call_b, opt_b = _build(kind, stage, precision, group, seed=1, lr=1e-3, model=fresh, persist=8)
    opt_b.load_state_dict(plain)
    if scaler is not None:
        opt_b.scaler.load_state_dict(scaler)
    cm.train(call_a, opt_a, 1, rank, first_step=10)
    cm.train(call_b, opt_b, 1, rank, first_step=10)
    pa, pb = cm.full_params(kind, model_a), cm.full_params(kind, model_b)
    out["step_diff"] = max((pa[k].float() - pb[k].float()).abs().max().item() for k in pa)
    out["tol"] = 0.0 if precision is None else 2e-2
    return out


def _load_all(rank, world, root):
    import functools

    return run_cases_in_own_groups(rank, world, {f"{n}->{t}": functools.partial(_load_case, root, n, t)
                                                 for n, t in LOADS[world]})


# -- interop and errors (2 ranks) ---------------------------------------------------------------------

def _plain(seed=0):
    model = cm.make(seed)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def case_zeroplus_to_torch(root, rank, group):
    """A zeroplus stage-2 checkpoint (s2) loads into a plain module + AdamW through torch's API."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    full, plain, _scaler = torch.load(os.path.join(root, "s2.handover"), weights_only=False)
    model, opt = _plain(seed=1)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(root, "s2"), process_group=group)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    params_differ = sorted(k for k, v in model.state_dict().items() if not torch.equal(v, full[k]))
    return {"params_differ": params_differ, "opt_diffs": optimizer_state_diffs(plain, opt.state_dict())}


def case_zeroplus_to_fsdp2(root, rank, group):
    """The s3 checkpoint (stage 3) loads into an FSDP2 (fully_shard) model + AdamW through torch's
    API: DCP reshards zeroplus's boxes into FSDP2's row shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    full, plain, _scaler = torch.load(os.path.join(root, "s3.handover"), weights_only=False)
    model = cm.make(1)
    fully_shard(model, mesh=DeviceMesh.from_group(group, "cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)  # over the DTensor parameters
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(root, "s3"), process_group=group)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    got_model, got_optim = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    names = [n for n, _p in cm.make(0).named_parameters()]
    by_index = {"state": {i: got_optim["state"][n] for i, n in enumerate(names) if n in got_optim["state"]},
                "param_groups": got_optim["param_groups"]}
    return {"sharded": type(model_sd["lin1.weight"]).__name__,
            "params_differ": sorted(k for k, v in got_model.items() if not torch.equal(v, full[k])),
            "opt_diffs": optimizer_state_diffs(plain, by_index)}


def case_torch_to_zeroplus(root, rank, group):
    """A checkpoint of a plain module + AdamW saved through torch's get_state_dict loads into a
    zeroplus stage-3 model (and into stage 1): the same parameters and optimizer state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import zeroplus

    model, opt = _plain(seed=0)
    cm.train(model, opt, 3, 0)  # the same batches on every rank: one replicated model
    path = os.path.join(root, "from_torch")
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, process_group=group)
    out = {}
    for stage in (3, 1):
        zmodel, _call, zopt = _build("engine", stage, None, group, seed=1, lr=1e-3)
        zmodel_sd, zoptim_sd = zeroplus.checkpoint.get_state_dict(zmodel, zopt)
        dcp.load({"model": zmodel_sd, "optim": zoptim_sd}, checkpoint_id=path, process_group=group)
        zeroplus.checkpoint.set_state_dict(zmodel, zopt, zmodel_sd, zoptim_sd)
        full = cm.full_params("engine", zmodel)
        out[f"params_differ{stage}"] = sorted(k for k, v in model.state_dict().items() if not torch.equal(v, full[k]))
        consolidated = cm.consolidated_optimizer(zopt, rank)
        out[f"opt_diffs{stage}"] = optimizer_state_diffs(opt.state_dict(), consolidated) if rank == 0 else []
    return out


def _snapshot(kind, model, opt, rank):
    return cm.full_params(kind, model), cm.consolidated_optimizer(opt, rank)


def _unchanged(before, after) -> bool:
    (pa, oa), (pb, ob) = before, after
    same_params = pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)
    return same_params and (oa is None or not optimizer_state_diffs(oa, ob))


class _Wider(cm.CkptNet):
    """lin1/lin2 of another width than the checkpoint's (a shape mismatch)."""

    def __init__(self):
        super().__init__(width=32)


class _Extra(cm.CkptNet):
    """One parameter the checkpoint lacks."""

    def __init__(self):
        super().__init__()
        self.extra = torch.nn.Parameter(torch.ones(5))


def case_dcp_load_mismatch(root, rank, group):
    """dcp.load of the s3 checkpoint into mismatched stage-2 models: torch's planner refuses
    before reading anything, naming the key; model and optimizer are untouched."""
    import torch.distributed.checkpoint as dcp

    import zeroplus
    from zeroplus.checkpoint import AioStorageReader

    out = {}
    for label, cls in (("shape", _Wider), ("missing", _Extra)):
        torch.manual_seed(3)
        model, call, opt = cm.build("engine", 2, None, group, seed=3, model=cls())
        cm.train(call, opt, 1, rank)
        before = _snapshot("engine", model, opt, rank)
        model_sd, optim_sd = zeroplus.checkpoint.get_state_dict(model, opt)
        try:
            dcp.load({"model": model_sd, "optim": optim_sd}, storage_reader=AioStorageReader(os.path.join(root, "s3")),
                     process_group=group)
            out[label] = None
        except BaseException as e:  # noqa: BLE001 - DCP raises CheckpointException, a BaseException
            out[label] = f"{type(e).__name__}: {e}"
        out[label + "_untouched"] = _unchanged(before, _snapshot("engine", model, opt, rank))
    return out


def case_set_state_dict_errors(root, rank, group):
    """set_state_dict with a dict that does not fit raises naming the key on every rank and
    changes nothing; bad arguments raise naming the argument."""
    import zeroplus
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    model, call, opt = _build("engine", 3, None, group, seed=4)
    cm.train(call, opt, 1, rank)
    before = _snapshot("engine", model, opt, rank)
    donor, dcall, dopt = _build("engine", 3, None, group, seed=5)  # the same layout: its dicts hold our ranges
    cm.train(dcall, dopt, 2, rank)
    out = {}

    def attempt(label, fn):
        try:
            fn()
            out[label] = None
        except Exception as e:  # noqa: BLE001 - the message is the result
            out[label] = f"{type(e).__name__}: {e}"

    def with_model(edit):
        msd, osd = zeroplus.checkpoint.get_state_dict(donor, dopt)
        edit(msd, osd)
        zeroplus.checkpoint.set_state_dict(model, opt, msd, osd)

    attempt("missing", lambda: with_model(lambda m, o: m.pop("lin2.bias")))
    attempt("shape", lambda: with_model(lambda m, o: m.__setitem__("scale", torch.ones(2))))
    attempt("unexpected", lambda: with_model(lambda m, o: m.__setitem__("nope", torch.ones(1))))
    attempt("optim_unknown", lambda: with_model(lambda m, o: o["state"].__setitem__("nope", {})))
    attempt("optim_shape", lambda: with_model(
        lambda m, o: o["state"]["lin1.weight"].__setitem__("exp_avg", torch.zeros(3, 3))))
    # only rank 1's dict is wrong: rank 0 must refuse too, naming rank 1
    attempt("one_rank", lambda: with_model(lambda m, o: m.pop("lin1.weight") if rank == 1 else None))
    out["untouched"] = _unchanged(before, _snapshot("engine", model, opt, rank))
    attempt("options", lambda: zeroplus.checkpoint.get_state_dict(model, opt,
                                                                  options=StateDictOptions(full_state_dict=True)))
    attempt("two_optimizers", lambda: zeroplus.checkpoint.get_state_dict(model, [opt, opt]))
    attempt("not_zeroplus", lambda: zeroplus.checkpoint.get_state_dict(model, torch.optim.SGD(model.parameters(), 0.1)))
    attempt("options_type", lambda: zeroplus.checkpoint.get_state_dict(model, opt, options={"strict": True}))
    attempt("optimizers_type", lambda: zeroplus.checkpoint.get_state_dict(model, 42))
    attempt("model_sd_type", lambda: zeroplus.checkpoint.set_state_dict(model, opt, [], {}))
    # Offloaded state lives in swap files, not in tensors DCP could view: refused, nothing made.
    import tempfile
    with tempfile.TemporaryDirectory() as nvme:
        for label, kw in (("offload_param", {"offload_param": {"device": "nvme", "nvme_path": nvme}}),
                          ("offload_optimizer", {"offload_optimizer": {"device": "nvme", "nvme_path": nvme}})):
            om, oo = zeroplus.initialize(cm.make(6), torch.optim.AdamW, lr=1e-2, process_group=group,
                                         config={"zero_optimization": {"stage": 3,
                                                                       "stage3_param_persistence_threshold": 0}},
                                         **kw)
            attempt(label, lambda: zeroplus.checkpoint.get_state_dict(om, oo))
            for store in (getattr(oo.placement, "param_store", None), oo.offload):
                if store is not None:
                    store.close()
    # a good round trip between two live engines still works afterwards (and changes the model)
    msd, osd = zeroplus.checkpoint.get_state_dict(donor, dopt)
    zeroplus.checkpoint.set_state_dict(model, opt, msd, osd)
    out["handover_equal"] = _unchanged(_snapshot("engine", donor, dopt, rank), _snapshot("engine", model, opt, rank))
    return out


def _interop_all(rank, world, root):
    import functools

    cases = {name[5:]: functools.partial(fn, root) for name, fn in globals().items() if name.startswith("case_")}
    return run_cases_in_own_groups(rank, world, cases)


# -- pytest ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1, 3, 2), (5, 1), (1,)], ids=str)
def test_boxes_tile_every_flat_range(shape):
    """Every flat range [lo, hi) of every shape: the boxes cover exactly its elements, once, in
    flat order, each one contiguous run (at most 2 * ndim - 1 of them)."""
    import math

    from zeroplus.checkpoint.dcp_state import boxes

    n = math.prod(shape)
    for lo in range(n + 1):
        for hi in range(lo, n + 1):
            hits = torch.zeros(shape, dtype=torch.int64)
            pos = lo
            found = boxes(shape, lo, hi)
            for offsets, sizes, start in found:
                assert start == pos, (shape, lo, hi, found)
                hits[tuple(slice(o, o + z) for o, z in zip(offsets, sizes))] += 1
                pos += math.prod(sizes)
            assert pos == hi and len(found) <= 2 * len(shape) - 1, (shape, lo, hi, found)
            flat = hits.reshape(-1)
            assert flat[lo:hi].eq(1).all() and flat[:lo].eq(0).all() and flat[hi:].eq(0).all(), (shape, lo, hi)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dcp_state"))
    out, t0 = {}, time.monotonic()
    out["save"] = run_pooled(_save_all, 2, root, timeout=300)
    for world in (1, 3):
        out[world] = run_pooled(_load_all, world, root, timeout=300)
    out["interop"] = run_pooled(_interop_all, 2, root, timeout=300)
    print(f"\ndcp_state: {len(SAVES)} saves at 2 ranks, {sum(map(len, LOADS.values()))} loads at 1 and 3 ranks, "
          f"interop and error cases at 2 ranks: {time.monotonic() - t0:.1f} s")
    return out


def _ok(per_rank: list, case: str) -> list:
    values = []
    for rank, res in enumerate(per_rank):
        status, value = res[case]
        assert status == "ok", f"rank {rank}:\n{value}"
        values.append(value)
    return values


@pytest.mark.parametrize("world,case", [(w, c) for w, cs in LOADS.items() for c in cs],
                         ids=[f"{c[0]}x2->x{w}stage{c[1]}" for w, cs in LOADS.items() for c in cs])
def test_reshard_through_dcp(results, world, case):
    for name in SAVES:
        _ok(results["save"], name)
    values = _ok(results[world], f"{case[0]}->{case[1]}")
    if world == 3 and case[1] != "zro":
        assert max(v["most_shards"] for v in values) > 1, "no rank held a parameter as several boxes"
    for rank, value in enumerate(values):
        assert value["in_place"] in (None, True), f"rank {rank}: dcp.load did not write into the engine's masters"
        if "scaler_equal" in value:
            assert value["scaler_equal"], f"rank {rank}: the fp16 loss scaler did not travel"
        assert value["params_differ"] == [], f"rank {rank}: loaded parameters differ from the saved ones"
        assert value["opt_diffs"] == [], f"rank {rank}: optimizer state differs: {value['opt_diffs'][:5]}"
        assert value["step_diff"] <= value["tol"], (
            f"rank {rank}: one step after the DCP load differs from the in-memory handover by {value['step_diff']}")


def test_zeroplus_checkpoint_loads_into_plain_torch(results):
    for value in _ok(results["interop"], "zeroplus_to_torch"):
        assert value["params_differ"] == [] and value["opt_diffs"] == [], value


def test_zeroplus_checkpoint_loads_into_fsdp2(results):
    for value in _ok(results["interop"], "zeroplus_to_fsdp2"):
        assert value["sharded"] == "DTensor", value
        assert value["params_differ"] == [] and value["opt_diffs"] == [], value


def test_plain_torch_checkpoint_loads_into_zeroplus(results):
    for value in _ok(results["interop"], "torch_to_zeroplus"):
        assert all(v == [] for v in value.values()), value


def test_dcp_load_into_mismatched_model_refused(results):
    for value in _ok(results["interop"], "dcp_load_mismatch"):
        assert value["shape"] is not None and "lin1.weight" in value["shape"] and "ize mismatch" in value["shape"], \
            value["shape"]
        assert value["missing"] is not None and "extra" in value["missing"], value["missing"]
        assert value["shape_untouched"] and value["missing_untouched"]


def test_set_state_dict_errors(results):
    for rank, value in enumerate(_ok(results["interop"], "set_state_dict_errors")):
        assert "Missing key(s) in state_dict: \"lin2.bias\"" in value["missing"], value["missing"]
        assert "size mismatch for scale" in value["shape"], value["shape"]
        assert "Unexpected key(s) in state_dict: \"nope\"" in value["unexpected"], value["unexpected"]
        assert "'nope'" in value["optim_unknown"], value["optim_unknown"]
        assert "['lin1.weight']['exp_avg']" in value["optim_shape"], value["optim_shape"]
        assert value["one_rank"] is not None and "lin1.weight" in value["one_rank"], value["one_rank"]
        if rank == 0:
            assert "rank 1" in value["one_rank"], value["one_rank"]
        assert value["untouched"], f"rank {rank}: a refused set_state_dict changed the model or optimizer"
        assert value["options"].startswith("ValueError") and "full_state_dict" in value["options"]
        assert value["two_optimizers"].startswith("ValueError") and "optimizers" in value["two_optimizers"]
        assert value["not_zeroplus"].startswith("TypeError") and "SGD" in value["not_zeroplus"]
        assert value["options_type"].startswith("TypeError") and "options" in value["options_type"]
        assert value["optimizers_type"].startswith("TypeError") and "optimizers" in value["optimizers_type"]
        assert value["model_sd_type"].startswith("TypeError") and "model_state_dict" in value["model_sd_type"]
        assert value["handover_equal"]
        for label in ("offload_param", "offload_optimizer"):
            assert value[label].startswith("NotImplementedError") and label in value[label], value[label]
