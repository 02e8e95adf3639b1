"""auto_plan(model, tp_size): find the attention and MLP projections of common transformer blocks
and return their Megatron-style tensor-parallel plan (a TensorParallelPlan, plan.py).

Recognised, by structure (module types and child names), never by downloading anything:

  HF GPT-2 attention   c_attn (Conv1D, fused q|k|v) column-parallel with each rank's heads of q, k
                       and v (styles.Conv1DColwise(fused=3)); c_proj (Conv1D) row-parallel;
                       per rank: num_heads / tp and split_size / tp (its forward splits c_attn's
                       output by split_size and infers the head count from it)
  HF GPT-2 MLP         c_fc column-parallel, c_proj row-parallel (Conv1D: weight is (in, out))
  Llama-style attention q_proj, k_proj, v_proj column-parallel, o_proj row-parallel (nn.Linear);
                       query and key/value head counts must divide by tp (a module attribute
                       num_heads / num_key_value_heads, where present, is divided)
  Llama-style MLP      gate_proj and up_proj column-parallel, down_proj row-parallel; likewise
                       (up_proj, down_proj), (fc1, fc2), (up, down)
  nn.TransformerEncoderLayer / DecoderLayer
                       linear1 column-parallel, linear2 row-parallel. Its attention
                       (nn.MultiheadAttention) stays replicated: the fused in_proj and the head
                       split happen inside F.multi_head_attention_forward, which checks the full
                       embedding width, so it cannot be split without replacing its forward.
  embeddings, LM head  vocabulary-parallel (get_input_embeddings(): RowwiseParallel over the
                       vocabulary; get_output_embeddings(): ColwiseParallel, logits gathered), tied
                       weights kept tied, when vocab_parallel is True, or None (the default) and
                       the vocabulary divides by tp_size (each rank then holds 1/tp of the usually
                       largest matrix of a small LM, for one all-reduce of the embeddings' output
                       and one all-gather of the logits).

Everything else (norms, position embeddings, biases of row-parallel layers) stays replicated. A
module that looks like a projection but cannot be split (heads or widths that do not divide by
tp_size, GPT-2 cross-attention) raises ValueError naming it; so does a model in which nothing was
recognised.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from .plan import TensorParallelPlan
from .styles import Conv1DColwise, Conv1DRowwise, is_conv1d

# (column-parallel children, row-parallel child) of the MLPs recognised, first match wins.
MLP_PATTERNS = ((("gate_proj", "up_proj"), "down_proj"), (("up_proj",), "down_proj"), (("fc1",), "fc2"),
                (("up",), "down"))
_TORCH_LAYERS = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
_MHA_WHY = ("nn.MultiheadAttention projects q|k|v with its fused in_proj inside F.multi_head_attention_forward, "
            "which checks the full embedding width: its heads cannot be split without replacing its forward")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _divides(what: str, name: str, value: int, tp: int) -> None:
    if value % tp:
        raise ValueError(f"auto_plan: cannot place {name}: {what} {value} does not divide by tp_size={tp}")


class _Planner:
    def __init__(self, model: nn.Module, tp: int):
        self.model, self.tp = model, tp
        self.styles, self.attributes, self.replicated = {}, {}, {}

    def linear(self, name: str, mod, column: bool) -> None:
        if not isinstance(mod, nn.Linear):
            raise ValueError(f"auto_plan: cannot place {name}: expected nn.Linear, got {type(mod).__name__}")
        _divides("out_features" if column else "in_features", name, mod.out_features if column else mod.in_features,
                 self.tp)
        self.styles[name] = ColwiseParallel() if column else RowwiseParallel()

    def gpt2_attention(self, name: str, mod) -> None:
        if hasattr(mod, "q_attn") or getattr(mod, "is_cross_attention", False):
            raise ValueError(f"auto_plan: cannot place {name}: GPT-2 cross-attention (q_attn, c_attn over the encoder "
                             f"states) is not planned")
        heads, split = getattr(mod, "num_heads", None), getattr(mod, "split_size", None)
        if not isinstance(heads, int) or not isinstance(split, int):
            raise ValueError(f"auto_plan: cannot place {name}: a fused c_attn without num_heads/split_size attributes")
        _divides("num_heads", name, heads, self.tp)
        self.styles[_join(name, "c_attn")] = Conv1DColwise(fused=3)
        self.styles[_join(name, "c_proj")] = Conv1DRowwise()
        self.attributes[name] = {"num_heads": heads // self.tp, "split_size": split // self.tp}

    def gpt2_mlp(self, name: str, mod) -> None:
        _divides("c_fc width", _join(name, "c_fc"), mod.c_fc.nf, self.tp)
        self.styles[_join(name, "c_fc")] = Conv1DColwise()
        self.styles[_join(name, "c_proj")] = Conv1DRowwise()

    def qkvo_attention(self, name: str, mod) -> None:
        head_dim = getattr(mod, "head_dim", None)
        if isinstance(head_dim, int) and head_dim > 0:
            _divides("query heads", name, mod.q_proj.out_features // head_dim, self.tp)
            _divides("key/value heads", name, mod.k_proj.out_features // head_dim, self.tp)
        for child in ("q_proj", "k_proj", "v_proj"):
            self.linear(_join(name, child), getattr(mod, child), column=True)
        self.linear(_join(name, "o_proj"), mod.o_proj, column=False)
        per_rank = {}
        for attr in ("num_heads", "num_key_value_heads"):
            value = getattr(mod, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                _divides(attr, name, value, self.tp)
                per_rank[attr] = value // self.tp
        if per_rank:
            self.attributes[name] = per_rank

    def mlp(self, name: str, mod, columns, row) -> None:
        for child in columns:
            self.linear(_join(name, child), getattr(mod, child), column=True)
        self.linear(_join(name, row), getattr(mod, row), column=False)

    def torch_layer(self, name: str, mod) -> None:
        self.linear(_join(name, "linear1"), mod.linear1, column=True)
        self.linear(_join(name, "linear2"), mod.linear2, column=False)
        for child in ("self_attn", "multihead_attn"):
            if isinstance(getattr(mod, child, None), nn.MultiheadAttention):
                self.replicated[_join(name, child)] = _MHA_WHY

    def visit(self, name: str, mod) -> bool:
        """Plans `mod` if it is a recognised block; True when its children need no visit."""
        kids = dict(mod.named_children())
        if isinstance(mod, _TORCH_LAYERS):
            self.torch_layer(name, mod)
            return True
        if is_conv1d(kids.get("c_attn")) and is_conv1d(kids.get("c_proj")):
            self.gpt2_attention(name, mod)
            return True
        if is_conv1d(kids.get("c_fc")) and is_conv1d(kids.get("c_proj")):
            self.gpt2_mlp(name, mod)
            return True
        if all(isinstance(kids.get(c), nn.Linear) for c in ("q_proj", "k_proj", "v_proj", "o_proj")):
            self.qkvo_attention(name, mod)
            return True
        for columns, row in MLP_PATTERNS:
            if all(isinstance(kids.get(c), nn.Linear) for c in (*columns, row)):
                self.mlp(name, mod, columns, row)
                return True
        if isinstance(mod, nn.MultiheadAttention):
            self.replicated[name] = _MHA_WHY
            return True
        return False

    def walk(self, name: str, mod) -> None:
        if not self.visit(name, mod):
            for child_name, child in mod.named_children():
                self.walk(_join(name, child_name), child)

    def vocabulary(self, vocab_parallel) -> tuple[tuple[str, str], ...]:
        """Embedding and LM head (HF's get_input/output_embeddings); returns the tied pairs."""
        get_in = getattr(self.model, "get_input_embeddings", None)
        get_out = getattr(self.model, "get_output_embeddings", None)
        emb = get_in() if callable(get_in) else None
        head = get_out() if callable(get_out) else None
        names = {id(m): n for n, m in self.model.named_modules()}
        emb = emb if isinstance(emb, nn.Embedding) and id(emb) in names else None
        head = head if isinstance(head, nn.Linear) and id(head) in names else None
        if emb is None and head is None:
            if vocab_parallel:
                raise ValueError(f"auto_plan: vocab_parallel=True but {type(self.model).__name__} has no "
                                 f"get_input_embeddings()/get_output_embeddings() returning nn.Embedding/nn.Linear")
            return ()
        vocab = emb.num_embeddings if emb is not None else head.out_features
        if vocab_parallel is None:
            vocab_parallel = self.tp > 1 and vocab % self.tp == 0
        if not vocab_parallel:
            for m in (emb, head):
                if m is not None:
                    self.replicated[names[id(m)]] = f"vocabulary {vocab} kept whole (vocab_parallel={vocab_parallel})"
            return ()
        if emb is not None:
            _divides("num_embeddings", names[id(emb)], emb.num_embeddings, self.tp)
            self.styles[names[id(emb)]] = RowwiseParallel(input_layouts=Replicate())
        if head is not None:
            _divides("out_features", names[id(head)], head.out_features, self.tp)
            self.styles[names[id(head)]] = ColwiseParallel(output_layouts=Replicate())
        if emb is not None and head is not None and emb.weight is head.weight:
            return ((_join(names[id(emb)], "weight"), _join(names[id(head)], "weight")),)
        return ()


def auto_plan(model: nn.Module, tp_size: int, *, vocab_parallel: bool | None = None) -> TensorParallelPlan:
    """The tensor-parallel plan of `model` for tp_size ranks (see the module doc). Changes nothing:
    plan.apply(model, mesh['tp']) parallelises, or zeroplus.initialize(..., tensor_parallel=mesh)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"auto_plan: model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(tp_size, bool) or not isinstance(tp_size, int):
        raise TypeError(f"auto_plan: tp_size must be an int, got {tp_size!r}")
    if tp_size < 1:
        raise ValueError(f"auto_plan: tp_size must be a positive int, got {tp_size!r}")
    if vocab_parallel is not None and not isinstance(vocab_parallel, bool):
        raise TypeError(f"auto_plan: vocab_parallel must be None, True or False, got {vocab_parallel!r}")
    planner = _Planner(model, tp_size)
    planner.walk("", model)
    if not planner.styles:
        raise ValueError(f"auto_plan: found no attention or MLP projection to place in {type(model).__name__} (known: "
                         f"HF GPT-2 Conv1D c_attn/c_proj/c_fc, q/k/v/o_proj, gate/up/down_proj, fc1/fc2, "
                         f"nn.TransformerEncoderLayer/DecoderLayer)")
    tied = planner.vocabulary(vocab_parallel)
    # A parameter shared by a planned module and another module would be split in one and whole in
    # the other: refuse rather than silently untie.
    owners: dict[int, list[str]] = {}
    for mod_name, mod in model.named_modules():
        for p in mod.parameters(recurse=False):
            owners.setdefault(id(p), []).append(mod_name)
    tied_names = {n.rpartition(".")[0] for pair in tied for n in pair}
    for mods in owners.values():
        planned = [m for m in mods if m in planner.styles]
        if planned and len(mods) > 1 and not set(mods) <= tied_names:
            others = sorted(set(mods) - {planned[0]})
            raise ValueError(f"auto_plan: cannot place {planned[0]}: its parameter is shared with {others}")
    return TensorParallelPlan(tp_size, planner.styles, planner.attributes, tied, planner.replicated)
