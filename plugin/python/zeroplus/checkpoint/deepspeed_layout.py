"""A DeepSpeed 0.19.8 ZeRO checkpoint on disk: where it is, what it holds, where each element lives.

    layout = DeepSpeedLayout(path)   # ROOT (its `latest` names the tag) or ROOT/global_stepN itself

Files of a tag directory (deepspeed/runtime/engine.py save_checkpoint):
  stages 1-2: mp_rank_00_model_states.pt (module state dict, param_shapes, buffers, shared
              parameters, lr_scheduler, step counters; frozen parameters only in the module state
              dict), and per data-parallel rank r
              [bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt: this rank's flat fp32 partition
              of each param group (padding removed), the base optimizer's state of that partition,
              the per-parameter alignment paddings, the loss scaler;
  stage 3:    zero_pp_rank_{r}_mp_rank_00_model_states.pt per rank (rank 0's holds the same
              metadata; each holds its frozen parameters' fragments) and the optim files above,
              holding one flat fp32 group per sub group.

Where an element lives (the same arithmetic as deepspeed/utils/zero_to_fp32.py, checked against
the file sizes here instead of trusted):
  stages 1-2: a param group is one flat vector, its parameters back to back in param_shapes
              order, each followed by its alignment padding; rank r's partition is the next
              numel(partition r) elements (only the tail padding is removed, so the partitions
              concatenate). Optimizer state tensors have the partition's layout (longer by the
              tail padding on the last rank: ignored).
  stage 3:    every parameter is split in world-size pieces of ceil(numel / world) elements
              (the last padded); rank r's flat group s is its pieces of sub group s's parameters
              back to back. The optimizer state of sub group s has the same layout.

`pieces[name]` lists, per parameter, (lo, hi, rank, group, offset): its flat elements [lo, hi)
are elements [offset, offset + hi - lo) of `rank`'s flat group `group` (masters and elementwise
optimizer state alike). Everything a loader trusts is checked here (DeepSpeedLayoutError naming
the file otherwise). Files are read only through deepspeed_pickle.safe_load; an optim file is
opened when first needed (open_rank) and memory-mapped, so a reader of a few ranges pages in
only those.
"""

from __future__ import annotations

import errno
import math
import os
import re

import torch

from .. import files
from .deepspeed_pickle import DynamicLossScaler, LossScaler, safe_load
from .format import LATEST, MANIFEST, CheckpointError, check_dir_name

_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_([0-9]+)_mp_rank_00_optim_states\.pt$")
_MODEL3 = re.compile(r"^zero_pp_rank_([0-9]+)_mp_rank_00_model_states\.pt$")
_MODEL12 = "mp_rank_00_model_states.pt"
_MAX_LATEST = 4096


class DeepSpeedLayoutError(CheckpointError):
    """A DeepSpeed checkpoint that is incomplete, inconsistent, or of a layout zeroplus does not read."""


def _is_tag_dir(path: str) -> bool:
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return MANIFEST not in names and any(_OPTIM.match(n) for n in names)


def resolve(path) -> str | None:
    """The tag directory `path` denotes if it is a DeepSpeed checkpoint (the directory itself, or
    the one its `latest` names), else None (not one: zeroplus's own format, or nothing)."""
    path = os.fspath(path)
    if _is_tag_dir(path):
        return path
    if os.path.isfile(os.path.join(path, MANIFEST)) or not os.path.lexists(os.path.join(path, LATEST)):
        return None
    dir_fd = files.open_directory_at(None, path)
    try:
        fd = files.open_regular_at(dir_fd, LATEST)
        try:
            data = os.pread(fd, _MAX_LATEST, 0)
        finally:
            os.close(fd)
    finally:
        os.close(dir_fd)
    name = data.decode(errors="replace").strip()
    tag = os.path.join(path, check_dir_name(name, os.path.join(path, LATEST)))
    return tag if _is_tag_dir(tag) else None


def _need(cond, where: str, what: str) -> None:
    if not cond:
        raise DeepSpeedLayoutError(errno.EINVAL, f"deepspeed checkpoint: {what}", where)


def _numel(shape) -> int:
    return math.prod(int(d) for d in shape)


class DeepSpeedLayout:
    def __init__(self, path):
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"deepspeed checkpoint: path must be a str or os.PathLike, got {type(path).__name__}")
        tag = resolve(path)
        if tag is None:
            raise DeepSpeedLayoutError(errno.ENOENT, "deepspeed checkpoint: no DeepSpeed ZeRO checkpoint here (no "
                                                     "*_optim_states.pt files, nor a `latest` naming a directory "
                                                     "of them)", os.fspath(path))
        self.path = tag
        self.dir_fd = files.open_directory_at(None, tag)
        self._optim: dict[int, dict] = {}
        try:
            self._discover()
        except BaseException:
            self.close()
            raise

    # -- files -----------------------------------------------------------------------------------

    def where(self, name: str) -> str:
        return os.path.join(self.path, name)

    def _load(self, name: str):
        fd = files.open_regular_at(self.dir_fd, name)
        try:  # torch maps the file through its own descriptor: this one can go right after
            return safe_load(fd, self.where(name))
        finally:
            os.close(fd)

    def close(self) -> None:
        self._optim.clear()
        if getattr(self, "dir_fd", None) is not None:
            os.close(self.dir_fd)
            self.dir_fd = None

    def open_rank(self, rank: int) -> dict:
        """Rank `rank`'s optimizer_state_dict (memory-mapped; cached until drop_rank)."""
        if rank not in self._optim:
            osd = self.open_rank_unchecked(rank)
            self._check_rank(rank, osd, self.where(self.optim_files[rank]))
            self._optim[rank] = osd
        return self._optim[rank]

    def drop_rank(self, rank: int) -> None:
        self._optim.pop(rank, None)

    # -- discovery ---------------------------------------------------------------------------------

    def _discover(self) -> None:
        names = os.listdir(self.dir_fd)
        optim = {}
        for n in names:
            m = _OPTIM.match(n)
            if m:
                _need(int(m.group(2)) not in optim, self.where(n), "two optim files for one rank")
                optim[int(m.group(2))] = n
        self.world = len(optim)
        _need(sorted(optim) == list(range(self.world)), self.path,
              f"optim files of ranks {sorted(optim)}: expected ranks 0..{self.world - 1} (a save that did not "
              f"complete)")
        self.optim_files = [optim[r] for r in range(self.world)]
        first = self.open_rank_unchecked(0)
        stage = first.get("zero_stage")
        _need(isinstance(stage, int) and int(stage) in (1, 2, 3), self.where(self.optim_files[0]),
              f"zero_stage {stage!r}: not a ZeRO stage 1-3 checkpoint")
        self.stage = int(stage)
        count = first.get("partition_count")
        if isinstance(count, (list, tuple)):
            _need(len(set(count)) <= 1, self.where(self.optim_files[0]), f"partition_count {list(count)} differs "
                  f"between param groups (MoE expert groups): not supported")
            count = count[0] if count else None
        _need(not any(n.startswith("expp_rank_") for n in names), self.path, "MoE expert files (expp_rank_*): not "
                                                                             "supported")
        _need(count == self.world, self.path, f"partition_count {count} but {self.world} optim files")
        model_name = _MODEL12 if self.stage < 3 else "zero_pp_rank_0_mp_rank_00_model_states.pt"
        _need(model_name in names, self.path, f"{model_name} is missing")
        self.model_file = model_name
        self.model_states = self._load(model_name)
        ms, where = self.model_states, self.where(model_name)
        _need(isinstance(ms, dict) and isinstance(ms.get("module"), dict) and isinstance(ms.get("param_shapes"), list)
              and isinstance(ms.get("buffer_names"), list), where, "not a DeepSpeed model states file (module, "
                                                                   "param_shapes, buffer_names)")
        config = ms.get("ds_config") if isinstance(ms.get("ds_config"), dict) else {}
        zero = config.get("zero_optimization") if isinstance(config.get("zero_optimization"), dict) else {}
        _need(not zero.get("round_robin_gradients"), where, "round_robin_gradients reorders the flat partitions; "
                                                            "zeroplus does not read such checkpoints")
        _need(zero.get("zero_hpz_partition_size", 1) in (None, 0, 1), where, "zero_hpz_partition_size > 1 (ZeRO++ "
                                                                             "hierarchical partitions): not supported")
        _need(ms.get("mp_world_size", 1) in (None, 1), where, "tensor/pipeline-parallel (mp_world_size > 1) "
                                                              "checkpoints are not supported")
        self.mixed_precision = ("bf16" if (config.get("bf16") or {}).get("enabled") else
                                "fp16" if (config.get("fp16") or {}).get("enabled") else None)
        self._describe(ms, where)
        paddings = first.get("param_alignment_paddings")
        del first  # _map holds one rank's file at a time
        self.pieces = self._map(paddings)

    def open_rank_unchecked(self, rank: int) -> dict:
        name = self.optim_files[rank]
        sd = self._load(name)
        _need(isinstance(sd, dict) and isinstance(sd.get("optimizer_state_dict"), dict), self.where(name),
              "no optimizer_state_dict in this optim file")
        return sd["optimizer_state_dict"]

    def _describe(self, ms: dict, where: str) -> None:
        """Names, shapes, groups, buffers, frozen and tied parameters from the model states file."""
        self.groups = []  # per flat group (stage 1-2: param group; stage 3: sub group): [(name, shape)]
        for g in ms["param_shapes"]:
            _need(isinstance(g, dict) and all(isinstance(n, str) and isinstance(s, (tuple, list, torch.Size))
                                              and all(isinstance(d, int) and d >= 0 for d in s) for n, s in g.items()),
                  where, "param_shapes must map parameter names to shapes")
            self.groups.append([(n, tuple(s)) for n, s in g.items()])
        self.shapes = {n: s for g in self.groups for n, s in g}
        _need(len(self.shapes) == sum(len(g) for g in self.groups), where, "a parameter is in two groups")
        module = ms["module"]
        # buffer_names lists non-persistent buffers too; the module state dict holds the others
        self.buffers = {n: module[n] for n in ms["buffer_names"] if isinstance(module.get(n), torch.Tensor)}
        shared = ms.get("shared_params") or {}
        _need(isinstance(shared, dict), where, "shared_params is malformed")
        self.aliases = {str(a): str(t) for a, t in shared.items()}
        frozen_shapes = ms.get("frozen_param_shapes") or {}
        self.frozen_fragments = ms.get("frozen_param_fragments") or {}
        _need(isinstance(frozen_shapes, dict) and isinstance(self.frozen_fragments, dict)
              and all(isinstance(s, (tuple, list, torch.Size)) and all(isinstance(d, int) and d >= 0 for d in s)
                      for s in frozen_shapes.values()), where, "frozen_param_shapes/fragments are malformed")
        if self.stage < 3 and not frozen_shapes:
            # Stages 1-2 record frozen parameters only in the module state dict (whole, model dtype):
            # what it holds beyond the optimizer's parameters, the buffers and the tied names.
            frozen_shapes = {n: v.shape for n, v in module.items() if isinstance(v, torch.Tensor) and n not in
                             self.shapes and n not in self.buffers and n not in self.aliases}
            self.frozen_fragments = {n: module[n] for n in frozen_shapes}
        self.frozen = {str(n): tuple(int(d) for d in s) for n, s in frozen_shapes.items()}
        for a, t in self.aliases.items():
            _need(t in self.shapes or t in self.frozen, where, f"shared parameter {a!r} names unknown {t!r}")
        self.dtypes = {}
        for n in list(self.shapes) + list(self.frozen):
            v = module.get(n)
            self.dtypes[n] = v.dtype if isinstance(v, torch.Tensor) else torch.float32
        for n, shape in self.frozen.items():
            v = self.frozen_fragments.get(n)
            _need(isinstance(v, torch.Tensor), where, f"frozen parameter {n!r} has no fragment")
            want = _numel(shape) if self.stage < 3 else -(-_numel(shape) // self.world)  # stage 3: rank 0's fragment
            _need(v.numel() == want, where, f"frozen parameter {n!r} has {v.numel()} elements here, its shape "
                                            f"{list(shape)} needs {want}")

    def frozen_fragment(self, name: str, rank: int) -> torch.Tensor:
        """Stage 3: rank `rank`'s fragment of frozen parameter `name` (ceil(numel / world) elements)."""
        if rank == 0:
            return self.frozen_fragments[name].reshape(-1)
        file = f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
        ms = self._load(file)
        v = (ms.get("frozen_param_fragments") or {}).get(name) if isinstance(ms, dict) else None
        _need(isinstance(v, torch.Tensor), self.where(file), f"frozen parameter {name!r} has no fragment")
        return v.reshape(-1)

    def _map(self, paddings) -> dict:
        """name -> [(lo, hi, rank, group, offset)] for every trainable parameter (stages 1-2:
        `paddings` is rank 0's param_alignment_paddings)."""
        pieces = {n: [] for n in self.shapes}
        if self.stage < 3:
            paddings = paddings if isinstance(paddings, list) else [[0] * len(g) for g in self.groups]
            where = self.where(self.optim_files[0])
            _need(len(paddings) == len(self.groups) and all(isinstance(p, list) and len(p) == len(g)
                                                            for p, g in zip(paddings, self.groups)),
                  where, "param_alignment_paddings do not match param_shapes")
            self.partition_numel = [[None] * len(self.groups) for _ in range(self.world)]
            for r in range(self.world):
                parts = self._fp32_groups(self.open_rank(r), r)
                for g, t in enumerate(parts):
                    self.partition_numel[r][g] = t.numel()
                del parts
                self.drop_rank(r)
            for g, names in enumerate(self.groups):
                starts = [0]
                for r in range(self.world):
                    starts.append(starts[-1] + self.partition_numel[r][g])
                offset = 0
                for (name, shape), pad in zip(names, paddings[g]):
                    lo_flat, n = offset, _numel(shape)
                    for r in range(self.world):
                        a, z = max(lo_flat, starts[r]), min(lo_flat + n, starts[r + 1])
                        if a < z:
                            pieces[name].append((a - lo_flat, z - lo_flat, r, g, a - starts[r]))
                    offset += n + int(pad)
                _need(offset == starts[-1], where,
                      f"param group {g}: its parameters need {offset} elements, the partitions hold {starts[-1]}")
        else:
            for r in range(self.world):
                parts = self._fp32_groups(self.open_rank(r), r)
                for g, names in enumerate(self.groups):
                    offset = 0
                    for name, shape in names:
                        n = _numel(shape)
                        part = -(-n // self.world)
                        lo, hi = min(r * part, n), min((r + 1) * part, n)
                        if lo < hi:
                            pieces[name].append((lo, hi, r, g, offset))
                        offset += part
                    _need(offset == parts[g].numel(), self.where(self.optim_files[r]),
                          f"sub group {g}: its parameters' partitions need {offset} elements, the file holds "
                          f"{parts[g].numel()}")
                del parts
                self.drop_rank(r)
        return pieces

    def _fp32_groups(self, osd: dict, rank: int) -> list:
        key = "single_partition_of_fp32_groups" if self.stage < 3 else "fp32_flat_groups"
        parts = osd.get(key)
        where = self.where(self.optim_files[rank])
        _need(isinstance(parts, list) and len(parts) == len(self.groups)
              and all(isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() == 1 for t in parts),
              where, f"{key} must hold one flat fp32 tensor per group of param_shapes ({len(self.groups)})")
        return parts

    def _check_rank(self, rank: int, osd: dict, where: str) -> None:
        stage = osd.get("zero_stage")
        _need(isinstance(stage, int) and int(stage) in ((1, 2) if self.stage < 3 else (3,)), where,
              f"zero_stage {stage!r} differs from rank 0's ({self.stage})")
        _need(len(self._fp32_groups(osd, rank)) == len(self.groups), where, "group count differs from rank 0's")

    # -- optimizer state ---------------------------------------------------------------------------

    def base_state(self, rank: int) -> tuple[list[dict], list[dict]]:
        """(per flat group: its optimizer state dict, per torch param group: its hyperparameters
        and the flat groups it holds, as {"hyper": {...}, "groups": [...]})."""
        osd = self.open_rank(rank)
        where = self.where(self.optim_files[rank])
        base = osd.get("base_optimizer_state" if self.stage < 3 else "optimizer_state_dict")
        if self.stage < 3 and isinstance(base, list):  # elastic_checkpoint: lean per-group states, step apart
            states = [dict(s) for s in base]
            step = osd.get("base_optimizer_state_step")
            groups = [{"hyper": {}, "groups": [g]} for g in range(len(self.groups))]
            if step is not None:
                for s in states:
                    s.setdefault("step", torch.tensor(float(step)))
        else:
            _need(isinstance(base, dict) and isinstance(base.get("state"), dict)
                  and isinstance(base.get("param_groups"), list), where, "the base optimizer state is not a torch "
                                                                         "optimizer state_dict")
            states = [dict(base["state"].get(g, {})) for g in range(len(self.groups))]
            groups = []
            for pg in base["param_groups"]:
                held = list(pg.get("params", []))
                _need(all(isinstance(i, int) and 0 <= i < len(self.groups) for i in held), where,
                      "a param group names an unknown flat group")
                hyper = {k: v for k, v in pg.items() if k != "params"}
                groups.append({"hyper": hyper, "groups": held})
                if "step" in hyper:  # DeepSpeed's fused Adam keeps the step count per param group
                    for i in held:
                        states[i].setdefault("step", torch.tensor(float(hyper["step"])))
            _need(sorted(i for pg in groups for i in pg["groups"]) == list(range(len(self.groups))), where,
                  "the base optimizer's param groups do not hold each flat group once")
        _need(len(states) == len(self.groups), where, "one optimizer state per flat group expected")
        parts = self._fp32_groups(osd, rank)
        for g, st in enumerate(states):
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    _need(v.numel() >= parts[g].numel(), where, f"optimizer state {k!r} of group {g} has {v.numel()} "
                                                                f"elements, the partition {parts[g].numel()}")
        return states, groups

    def loss_scaler(self) -> dict:
        """DeepSpeed's loss scaler as plain values: {"scale", "dynamic", and for a dynamic one
        "iteration", "last_overflow_iteration", "hysteresis_left"}."""
        s = self.open_rank(0).get("loss_scaler")
        if isinstance(s, DynamicLossScaler):
            d = vars(s)
            return {"scale": float(d.get("cur_scale", 1.0)), "dynamic": True, "iteration": int(d.get("cur_iter", 0)),
                    "last_overflow_iteration": int(d.get("last_overflow_iter", -1)),
                    "hysteresis_left": int(d.get("cur_hysteresis", 1))}
        if isinstance(s, LossScaler):
            return {"scale": float(vars(s).get("cur_scale", 1.0)), "dynamic": False}
        return {"scale": 1.0, "dynamic": False}

    def client_values(self) -> dict:
        """What DeepSpeed's engine saved besides the model and optimizer: lr_scheduler, global_steps,
        global_samples, skipped_steps, and the client_state keys (anything else it holds)."""
        known = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
                 "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
                 "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
                 "checkpoint_parallel_dimensions", "ds_config", "ds_version"}
        ms = self.model_states
        return {"lr_scheduler": ms.get("lr_scheduler"), "global_steps": ms.get("global_steps"),
                "global_samples": ms.get("global_samples"), "skipped_steps": ms.get("skipped_steps", 0),
                "ds_version": ms.get("ds_version"),
                "client_state": {k: v for k, v in ms.items() if k not in known}}
