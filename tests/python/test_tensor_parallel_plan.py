"""zeroplus.tensor_parallel.auto_plan (docs/tensor_parallel.md) on HF GPT-2 (Conv1D, fused c_attn, tied
LM head), HF Llama (q/k/v/o, gate/up/down, grouped key/value heads) and nn.TransformerEncoder.

Several ranks (4 as a 2 x 2 ("dp", "tp") mesh, one launch, one mesh): each family, built from a
config with the same seed on every rank, is planned and applied over "tp"; its logits (and its
state dict's global values) must match the unparallelised model's, and a backward must run. GPT-2
then trains through zeroplus.initialize(..., tensor_parallel=mesh) and must match the DP-only
reference (the mean of the two dp ranks' losses, torch SGD) after 5 steps, and in bf16 at stage 2
stays close to the fp32 reference.
One process (no group): the plans' contents and every error, naming the module it cannot place.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch

from harness import run_pooled

SEQ, VOCAB = 8, 64


def _gpt2(**extra):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = dict(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
               attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(GPT2Config(**{**cfg, **extra}))


def _llama(**extra):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=16, bos_token_id=0, eos_token_id=0)
    return LlamaForCausalLM(LlamaConfig(**{**cfg, **extra}))


def _encoder():
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    return torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


BUILDERS = {"gpt2": _gpt2, "llama": _llama, "encoder": _encoder}


def _forward(family, model, x):
    return model(x) if family == "encoder" else model(x).logits


def _inputs(family):
    g = torch.Generator().manual_seed(3)
    if family == "encoder":
        return torch.randn(2, SEQ, 32, generator=g)
    return torch.randint(0, VOCAB, (2, SEQ), generator=g)


def _logits_parity(mesh, family):
    from torch.distributed.tensor import DTensor

    from zeroplus.tensor_parallel import auto_plan

    torch.manual_seed(0)
    ref = BUILDERS[family]()
    model = copy.deepcopy(ref)
    plan = auto_plan(model, mesh["tp"].size())
    plan.apply(model, mesh["tp"])
    sharded = [n for n, p in model.named_parameters() if isinstance(p, DTensor) and not p.placements[0].is_replicate()]
    x = _inputs(family)
    out, expected = _forward(family, model, x), _forward(family, ref, x)
    logits_err = (out - expected).abs().max().item()
    out.square().mean().backward()  # gradients flow through every placed module
    ref_state = ref.state_dict()
    state_err = max((v.full_tensor() if isinstance(v, DTensor) else v).sub(ref_state[k]).abs().max().item()
                    for k, v in model.state_dict().items())
    # Checked after the last collective (full_tensor): a rank failing alone leaves no peer waiting.
    assert all(model.get_parameter(n).grad is not None for n in sharded)
    if family == "gpt2":
        assert model.lm_head.weight is model.transformer.wte.weight  # the tie survived
    assert logits_err < 1e-5 and state_err == 0.0, (logits_err, state_err)
    return {"logits_err": logits_err, "sharded_params": len(sharded), "replicated_modules": len(plan.replicated)}


def _gpt2_trains_through_initialize(mesh):
    import zeroplus

    torch.manual_seed(0)
    ref = _gpt2()
    model, opt = zeroplus.initialize(copy.deepcopy(ref), torch.optim.SGD, stage=1, tensor_parallel=mesh, lr=0.1,
                                     momentum=0.9)
    assert type(opt).__name__ == "Stage1Optimizer" and opt.tp_group is not None
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    dp_rank = mesh["dp"].get_local_rank()
    g = torch.Generator().manual_seed(5)
    norm_err = 0.0
    for _ in range(5):
        ids = [torch.randint(0, VOCAB, (2, SEQ), generator=g) for _ in range(2)]
        model(ids[dp_rank], labels=ids[dp_rank]).loss.backward()
        # The norm covers c_attn's strided shards (each tp rank holds its heads of q, k and v).
        norm = opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        (sum(ref(i, labels=i).loss for i in ids) / 2).backward()
        norm_err = max(norm_err, abs(norm.item() - torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0).item()))
        ref_opt.step()
        ref_opt.zero_grad()
    from torch.distributed.tensor import DTensor

    err = max(((p.full_tensor() if isinstance(p, DTensor) else p) - q).abs().max().item()
              for p, q in zip(model.parameters(), ref.parameters()))
    assert err < 1e-5 and norm_err < 1e-5, (err, norm_err)
    return {"param_err": err, "norm_err": norm_err}


def _gpt2_bf16_stage2(mesh):
    """The bench's configuration: GPT-2, TP2 x ZeRO-2, bf16 (the strided c_attn shards in bf16)."""
    import zeroplus
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    ref = _gpt2()
    model, opt = zeroplus.initialize(copy.deepcopy(ref), torch.optim.AdamW, stage=2, tensor_parallel=mesh, lr=1e-3,
                                     mixed_precision="bf16")
    c_attn = model.transformer.h[0].attn.c_attn.weight
    assert c_attn.dtype == torch.bfloat16 and c_attn.to_local().dtype == torch.bfloat16
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    dp_rank = mesh["dp"].get_local_rank()
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        ids = [torch.randint(0, VOCAB, (2, SEQ), generator=g) for _ in range(2)]
        model(ids[dp_rank], labels=ids[dp_rank]).loss.backward()
        opt.step()
        opt.zero_grad()
        (sum(ref(i, labels=i).loss for i in ids) / 2).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    err = max(((p.full_tensor() if isinstance(p, DTensor) else p).float() - q).abs().max().item()
              for p, q in zip(model.parameters(), ref.parameters()))
    assert err < 2e-2, err  # the bf16 rounding of the weights
    report = zeroplus.memory_report(model, opt)
    return {"param_err": err, "model_state_bytes": report["model_state"]}


CASES = {"gpt2": (_logits_parity, "gpt2"), "llama": (_logits_parity, "llama"),
         "encoder": (_logits_parity, "encoder"), "gpt2_train": (_gpt2_trains_through_initialize,),
         "gpt2_bf16": (_gpt2_bf16_stage2,)}


def _all_cases(rank, world):
    import tp_models as tm

    return tm.run_cases(CASES)


@pytest.fixture(scope="module")
def results():
    start = time.monotonic()
    out = run_pooled(_all_cases, 4, timeout=600)
    print(f"\n4 ranks, all cases: {time.monotonic() - start:.1f} s")
    return out


@pytest.mark.parametrize("key", list(CASES))
def test_auto_plan_parity(results, key):
    for rank, per_rank in enumerate(results):
        status, value, _seconds = per_rank[key]
        if status != "ok":
            pytest.fail(f"case {key} failed on rank {rank}:\n{value}")
    print(f"{key}: {results[0][key][1]} ({results[0][key][2]:.1f} s)")


# -- one process: the plans and the errors -------------------------------------------------------


def test_plans_name_what_they_place():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from zeroplus.tensor_parallel import Conv1DColwise, Conv1DRowwise, auto_plan

    plan = auto_plan(_gpt2(), 2)
    assert isinstance(plan.styles["transformer.h.1.attn.c_attn"], Conv1DColwise)
    assert plan.styles["transformer.h.1.attn.c_attn"].fused == 3
    assert isinstance(plan.styles["transformer.h.0.mlp.c_proj"], Conv1DRowwise)
    assert plan.attributes["transformer.h.0.attn"] == {"num_heads": 2, "split_size": 16}
    assert plan.tied == (("transformer.wte.weight", "lm_head.weight"),)
    plan = auto_plan(_llama(), 2)
    assert isinstance(plan.styles["model.layers.0.self_attn.k_proj"], ColwiseParallel)
    assert isinstance(plan.styles["model.layers.0.mlp.down_proj"], RowwiseParallel)
    assert isinstance(plan.styles["model.embed_tokens"], RowwiseParallel)
    plan = auto_plan(_encoder(), 2)
    assert set(plan.styles) == {f"layers.{i}.linear{j}" for i in (0, 1) for j in (1, 2)}
    assert set(plan.replicated) == {"layers.0.self_attn", "layers.1.self_attn"}
    # A vocabulary that does not divide stays whole; vocab_parallel=False keeps it whole anyway.
    assert "transformer.wte" in auto_plan(_gpt2(), 2, vocab_parallel=False).replicated
    assert "transformer.wte" not in auto_plan(_gpt2(vocab_size=VOCAB + 1), 2).styles


@pytest.mark.parametrize("build,tp,match", [
    (lambda: _gpt2(), 3, "cannot place transformer.h.0.attn: num_heads 4 does not divide by tp_size=3"),
    (lambda: _llama(), 4, "cannot place model.layers.0.self_attn: key/value heads 2 does not divide by tp_size=4"),
    (lambda: _gpt2(add_cross_attention=True), 2, "cannot place transformer.h.0.crossattention: GPT-2 cross-attention"),
    (lambda: torch.nn.Sequential(torch.nn.Linear(4, 4)), 2,
     "found no attention or MLP projection to place in Sequential"),
    (lambda: _gpt2(), 0, "tp_size must be a positive int"),
])
def test_auto_plan_errors(build, tp, match):
    from zeroplus.tensor_parallel import auto_plan

    with pytest.raises(ValueError, match=match):
        auto_plan(build(), tp)


def test_auto_plan_argument_errors():
    from zeroplus.tensor_parallel import Conv1DColwise, TensorParallelPlan, auto_plan

    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        auto_plan("gpt2", 2)
    for bad in ("2", 2.0, True):
        with pytest.raises(TypeError, match="tp_size must be an int"):
            auto_plan(_gpt2(), bad)
        with pytest.raises(TypeError, match="tp_size must be an int"):
            TensorParallelPlan(bad, {})
    with pytest.raises(ValueError, match="tp_size must be a positive int"):
        TensorParallelPlan(0, {})
    with pytest.raises(TypeError, match="vocab_parallel must be None, True or False"):
        auto_plan(_gpt2(), 2, vocab_parallel="yes")
    with pytest.raises(ValueError, match="vocab_parallel=True but TransformerEncoder has no"):
        auto_plan(_encoder(), 2, vocab_parallel=True)
    with pytest.raises(ValueError, match="fused must be a positive int"):
        Conv1DColwise(fused=0)
    with pytest.raises(TypeError, match=r"styles\['a'\] must be a ParallelStyle"):
        TensorParallelPlan(2, {"a": "colwise"})


def test_apply_errors_leave_the_model(one_rank_group):
    import zeroplus
    from torch.distributed.device_mesh import init_device_mesh

    from zeroplus.tensor_parallel import auto_plan

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    model = _gpt2()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="made for tp_size=2, tp_mesh has 1 ranks"):
        auto_plan(model, 2).apply(model, mesh)
    with pytest.raises(ValueError, match="model has no module 'model.layers.0.self_attn.q_proj'"):
        auto_plan(_llama(), 1).apply(model, mesh)
    with pytest.raises(TypeError, match="tp_mesh must be a DeviceMesh"):
        auto_plan(model, 1).apply(model, "tp")
    with pytest.raises(TypeError, match="tensor_parallel must be a 2-D DeviceMesh"):
        zeroplus.initialize(model, torch.optim.SGD, stage=1, lr=0.1, tensor_parallel="tp")
    with pytest.raises(ValueError, match="tensor_parallel must be a 2-D DeviceMesh with mesh_dim_names"):
        zeroplus.initialize(model, torch.optim.SGD, stage=1, lr=0.1, tensor_parallel=mesh)
    with pytest.raises(ValueError, match="tensor_parallel needs stage=1 or stage=2"):
        zeroplus.initialize(model, torch.optim.SGD, stage=3, lr=0.1, tensor_parallel=mesh)
    after = model.state_dict()
    assert all(type(after[k]) is torch.Tensor and torch.equal(after[k], v) for k, v in before.items())


def test_already_parallel_and_bad_placements(one_rank_group):
    """A model parallelised twice, and DTensor parameters the engine cannot take (a Partial
    placement, a 2-D mesh): ValueError naming the problem, nothing changed."""
    import zeroplus
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate

    from zeroplus.tensor_parallel import auto_plan

    mesh2 = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    model = _llama()
    plan = auto_plan(model, 1)
    plan.apply(model, mesh2["tp"])
    assert isinstance(model.model.layers[0].self_attn.q_proj.weight, DTensor)
    with pytest.raises(ValueError, match="model.layers.0.self_attn.q_proj is already parallelised"):
        plan.apply(model, mesh2["tp"])
    with pytest.raises(ValueError, match="model is already tensor-parallel"):
        zeroplus.initialize(model, torch.optim.SGD, stage=1, lr=0.1, tensor_parallel=mesh2)

    def param(placement, mesh):
        return torch.nn.Parameter(DTensor.from_local(torch.ones(4), mesh, [placement] * mesh.ndim, run_check=False))

    for p, match in ((param(Partial(), mesh2["tp"]), "has a Partial placement"),
                     (param(Replicate(), mesh2), r"lives on a 2-D mesh \('dp', 'tp'\)")):
        with pytest.raises(ValueError, match=match):
            zeroplus.ZeroRedundancyOptimizer([p], torch.optim.SGD, lr=0.1)
        assert not getattr(p, "_zeroplus_managed", False) and torch.equal(p.to_local(), torch.ones(4))
