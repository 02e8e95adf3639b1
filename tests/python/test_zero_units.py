"""Stage-3 unit policy (zeroplus/zero/stage3/units.py): which submodules are gather units, who owns a
tied parameter, what each unit needs. Single process, no process group."""

import pytest
from torch import nn

import zero_models as zm
from zeroplus.zero.stage3.units import build_units


def _names(units):
    return [u.name for u in units]


def _has(params, p):
    return any(q is p for q in params)  # `in` would compare tensors element-wise


def test_default_policy_splits_list_elements_and_keeps_root_last():
    units = build_units(zm.make_model(layers=3))
    # nn.TransformerEncoder holds a ModuleList: its layers are units, not the encoder itself.
    assert _names(units) == ["embed", "blocks.layers.0", "blocks.layers.1", "blocks.layers.2", "norm", "head", ""]
    by_name = {u.name: u for u in units}
    # The tied LM head owns nothing and needs the embedding's unit.
    assert not by_name["head"].owned and by_name["head"].needs == [by_name["embed"].index]
    assert len(by_name[""].owned) == 1 and by_name[""].owned[0] is units[-1].module.position
    # Every parameter has exactly one owner.
    owned = [id(p) for u in units for p in u.owned]
    assert sorted(owned) == sorted(id(p) for p in units[-1].module.parameters())


def test_multihead_attention_stays_in_one_unit():
    # MultiheadAttention reads out_proj.weight without calling out_proj: they must share a unit.
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    model = nn.Sequential(layer, nn.Linear(16, 4))
    units = build_units(model)
    assert _names(units) == ["0", "1", ""]
    assert _has(units[0].owned, layer.self_attn.out_proj.weight) and _has(units[0].owned, layer.self_attn.in_proj_weight)


def test_unit_classes_pick_instances_outermost_first():
    model = zm.make_model(layers=2)
    units = build_units(model, [nn.TransformerEncoderLayer, nn.Linear])
    # Linear layers inside the encoder layers are covered by their layer; the head is a unit.
    assert _names(units) == ["blocks.layers.0", "blocks.layers.1", "head", ""]
    root = units[-1]
    assert _has(root.owned, model.embed.weight) and _has(root.owned, model.norm.weight)
    # The head reuses the embedding weight, which the root unit owns (registered first).
    assert units[2].needs == [root.index]


def test_unit_classes_must_be_module_classes():
    with pytest.raises(TypeError, match="unit_classes"):
        build_units(zm.make_model(), [int])


def test_frozen_and_shared_modules():
    shared = nn.Linear(4, 4)
    model = nn.ModuleDict({"a": nn.Sequential(shared, nn.ReLU(), shared), "b": nn.Linear(4, 2)})
    model.b.requires_grad_(False)
    units = build_units(model)
    # The shared Linear is reached twice through the Sequential: one unit for it (first path).
    assert _names(units) == ["a.0", "b", ""]
    assert [id(p) for p in units[0].owned] == [id(shared.weight), id(shared.bias)]
    assert [id(p) for p in units[1].owned] == [id(model.b.weight), id(model.b.bias)]


def test_torch_compile_wrappers_are_seen_through():
    import torch

    # initialize(torch.compile(model)): the compiled root's children are the root's own, so the
    # units are the uncompiled model's (names under `_orig_mod.`, as the wrapper's state_dict).
    model = zm.make_model(layers=2)
    plain = build_units(model)
    compiled = build_units(torch.compile(model, backend="eager"))
    assert _names(compiled) == ["_orig_mod." + n if n else n for n in _names(plain)]
    assert [[id(p) for p in u.owned] for u in compiled] == [[id(p) for p in u.owned] for u in plain]
    # torchtitan's order (each block compiled in its list, then sharded): the wrapper is the unit,
    # also when unit_classes names the block class, so the gather hooks run outside its graph.
    model = zm.make_model(layers=2)
    for i, layer in enumerate(model.blocks.layers):
        model.blocks.layers[i] = torch.compile(layer, backend="eager")
    for classes in (None, [nn.TransformerEncoderLayer]):
        units = build_units(model, classes)
        blocks = [u for u in units if u.name.startswith("blocks.")]
        assert [u.name for u in blocks] == ["blocks.layers.0", "blocks.layers.1"]
        assert all(u.module is model.blocks.layers[i] for i, u in enumerate(blocks))


def test_persistent_modules_resolve_to_their_subtrees_parameters():
    from zeroplus.zero.policies import Stage3Policy
    from zeroplus.zero.stage3.units import kept_whole

    model = nn.ModuleDict({"trunk": nn.Linear(4, 4),
                           "experts": nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]), "norm": nn.LayerNorm(4)})
    ids = lambda m: {id(p) for p in m.parameters()}  # noqa: E731
    assert kept_whole(model, Stage3Policy(persistent_modules="experts").persistent_modules) == ids(model.experts)
    assert kept_whole(model, Stage3Policy(persistent_modules=model.experts[1]).persistent_modules) == \
        ids(model.experts[1])
    # A class picks every instance; a container instance is one module, not a list of its children.
    assert kept_whole(model, Stage3Policy(persistent_modules=[nn.LayerNorm, "experts.0"]).persistent_modules) == \
        ids(model.norm) | ids(model.experts[0])
    assert kept_whole(model, Stage3Policy().persistent_modules) == set()
    for bad, exc in (("expert", ValueError), ([nn.Conv1d], ValueError), ([nn.Linear(1, 1)], ValueError)):
        with pytest.raises(exc, match="persistent_modules"):
            kept_whole(model, Stage3Policy(persistent_modules=bad).persistent_modules)
    for bad in (3, [int], [None]):
        with pytest.raises(TypeError, match="persistent_modules"):
            Stage3Policy(persistent_modules=bad)
