"""A DeepSpeed ZeRO checkpoint seen through CheckpointReader's interface (the bridge into load.py).

    reader = DeepSpeedReader(path, adapter)   # what sources.open_reader returns for a DeepSpeed checkpoint
    reader.manifest                          # a zeroplus manifest (format.py) describing it
    reader.read_many([(name, key, lo, hi)])  # flat element ranges, as CheckpointReader.read_many

So zeroplus.load_checkpoint loads a DeepSpeed checkpoint through its own path, unchanged: the
strict model check (missing, unexpected, mis-shaped keys named), every rank reads what it owns
now, the ranks agree, and only then the model and optimizer change. The manifest is built from
the DeepSpeed files (deepspeed_layout.py) and, when the loading optimizer is known (`adapter`,
checkpoint/adapters.py), fitted to it before anything is read:
  * param groups: DeepSpeed's torch param group i must hold the same trainable parameters as the
    optimizer's group i (load.py's group check names the differing ones); the hyperparameters the loading
    optimizer's group has are taken from the checkpoint where it has them (lr, betas, eps,
    weight_decay, ...), the others (DeepSpeed's own keys: bias_correction, adam_w_mode, ...) are
    left out, and the loading group keeps its own (initial_lr of its scheduler, ...);
  * optimizer state: the elementwise keys must be the ones the loading optimizer keeps (ValueError
    naming both sets: a checkpoint of another optimizer class); the step count takes the loading
    optimizer's form (a 0-dim float32 tensor for torch's Adam/AdamW);
  * loss scaler: an fp16 dynamic scaler's scale, iteration, last overflow and hysteresis go into
    a loading fp16 engine's scaler; other combinations keep the loading run's scaler (as
    zeroplus's own format does across precisions);
  * extra (what load_checkpoint returns): {"lr_scheduler": the engine scheduler's state_dict
    (None without one), "global_steps", "global_samples", "skipped_steps", "ds_version",
    "client_state": the client_state keys of engine.save_checkpoint}.
Values are fp32 masters and fp32 optimizer state (DeepSpeed keeps both in fp32 at every precision),
buffers and frozen parameters in their saved dtype. manifest_crc32 identifies the checkpoint (its
directory and every file's size and mtime) so the ranks can check they read the same one.
"""

from __future__ import annotations

import errno
import os
import zlib

import torch

from .deepspeed_layout import DeepSpeedLayout, DeepSpeedLayoutError
from .format import VERSION, encode_value

# DeepSpeed's own optimizer hyperparameters, dropped when no loading optimizer says which to keep
# (convert): a torch optimizer's load_state_dict would carry them into its groups.
_DEEPSPEED_ONLY_KEYS = {"bias_correction", "adam_w_mode", "set_grad_none", "step", "torch_adam"}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _elementwise(v) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() > 0


class DeepSpeedReader:
    def __init__(self, path, adapter=None):
        self.layout = DeepSpeedLayout(path)
        try:
            self.path = self.layout.path
            self._states: dict[int, list] = {}
            self.manifest_crc32 = self._identity()
            self.manifest = self._manifest(adapter)
        except BaseException:
            self.layout.close()
            raise

    def close(self) -> None:
        self.layout.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _identity(self) -> int:
        crc = zlib.crc32(os.path.realpath(self.path).encode())
        for name in sorted(os.listdir(self.layout.dir_fd)):
            st = os.stat(name, dir_fd=self.layout.dir_fd, follow_symlinks=False)
            crc = zlib.crc32(f"{name}:{st.st_size}:{st.st_mtime_ns}".encode(), crc)
        return crc

    def drop_rank(self, rank: int) -> None:
        """Forget rank `rank`'s optim file (its mapping goes once nothing else holds its tensors)."""
        self._states.pop(rank, None)
        self.layout.drop_rank(rank)

    def _rank_states(self, rank: int) -> list:
        if rank not in self._states:
            self._states[rank] = self.layout.base_state(rank)[0]
        return self._states[rank]

    # -- the manifest ----------------------------------------------------------------------------

    def _manifest(self, adapter) -> dict:
        lay = self.layout
        states0, torch_groups = lay.base_state(0)
        self._states[0] = states0
        template = self._template(adapter)
        tensors = {}
        for g, names in enumerate(lay.groups):
            st = states0[g]
            keys = sorted(k for k, v in st.items() if _elementwise(v))
            scalars = {k: v for k, v in st.items() if not _elementwise(v)}
            if template is not None and st:
                want = sorted(k for k, v in template.items() if _elementwise(v))
                if keys != want:
                    raise ValueError(f"load_checkpoint: the DeepSpeed checkpoint's optimizer state holds {keys} per "
                                     f"parameter, this optimizer keeps {want} (a checkpoint of another optimizer "
                                     f"class)")
                scalars = {k: self._like(v, template.get(k)) for k, v in scalars.items() if k in template}
            elif "step" in scalars and not isinstance(scalars["step"], torch.Tensor):
                # convert: DeepSpeed's FusedAdam counts in a Python int; torch's Adam/AdamW keep a 0-dim fp32 tensor
                scalars["step"] = torch.tensor(float(scalars["step"]))
            for name, shape in names:
                tensors[name] = {"shape": list(shape), "dtype": dtype_name(lay.dtypes[name]), "kind": "param",
                                 "trainable": True, "state": {k: "float32" for k in keys},
                                 "scalars": {k: encode_value(v) for k, v in scalars.items()}}
        for name, shape in lay.frozen.items():
            tensors[name] = {"shape": list(shape), "dtype": dtype_name(lay.dtypes[name]), "kind": "param",
                             "trainable": False}
        for name, b in lay.buffers.items():
            tensors[name] = {"shape": list(b.shape), "dtype": dtype_name(b.dtype), "kind": "buffer"}
        for t in tensors.values():
            t["numel"] = int(torch.Size(t["shape"]).numel())
        client = lay.client_values()
        return {"format": "deepspeed", "version": VERSION,
                "source": {"engine": "deepspeed", "stage": lay.stage, "world_size": lay.world,
                           "mixed_precision": lay.mixed_precision, "optimizer_class": None,
                           "deepspeed_version": client["ds_version"]},
                "tensors": tensors, "aliases": dict(lay.aliases),
                "param_groups": self._groups(torch_groups, adapter),
                "optimizer": {"loss_scaler": self._scaler(adapter), "skipped_steps": int(client["skipped_steps"] or 0)},
                "extra": client}

    @staticmethod
    def _template(adapter):
        """The state the loading optimizer creates for a parameter; None without a loading
        optimizer, or where this rank owns no optimizer state (nothing to fit here: the ranks
        that own some check it, and every rank raises if one of them fails)."""
        if adapter is None:
            return None
        return next((st for st in adapter.fresh_optimizer_states().values() if st), None)

    @staticmethod
    def _like(value, like):
        """A DeepSpeed scalar (the step) in the loading optimizer's form."""
        number = float(value.item()) if isinstance(value, torch.Tensor) else float(value)
        if isinstance(like, torch.Tensor):
            return torch.tensor(number, dtype=like.dtype)
        return type(like)(number) if isinstance(like, (int, float)) else value

    def _groups(self, torch_groups: list, adapter) -> list:
        lay = self.layout
        names_of = [[n for g in tg["groups"] for n, _s in lay.groups[g]] for tg in torch_groups]
        if adapter is None:  # convert: frozen parameters in group 0, where zeroplus.initialize(model, ...) holds them
            frozen = list(lay.frozen)
            return [{**{k: encode_value(v) for k, v in tg["hyper"].items() if k not in _DEEPSPEED_ONLY_KEYS},
                     "params": names + (frozen if i == 0 else [])}
                    for i, (tg, names) in enumerate(zip(torch_groups, names_of))]
        mine = adapter.opt.param_groups
        if len(mine) != len(torch_groups):
            raise ValueError(f"load_checkpoint: the DeepSpeed checkpoint has {len(torch_groups)} param groups, the "
                             f"optimizer has {len(mine)}")
        out = []
        for tg, names, g in zip(torch_groups, names_of, mine):
            # DeepSpeed's groups hold only trainable parameters; the frozen ones the optimizer's group
            # holds count as saved there. Any other difference is named by load.py's group check,
            # after its model check (missing, unexpected, mis-shaped keys first, as for zeroplus's format).
            frozen = [adapter.name_of[id(p)] for p in g["params"] if not p.requires_grad]
            hyper = {k: (tg["hyper"][k] if k in tg["hyper"] else v) for k, v in g.items() if k != "params"}
            out.append({**{k: encode_value(v) for k, v in hyper.items()}, "params": names + frozen})
        return out

    def _scaler(self, adapter) -> dict:
        ds = self.layout.loss_scaler()
        current = getattr(getattr(adapter, "opt", None), "scaler", None) if adapter is not None else None
        if current is None:  # convert: the fields zeroplus's dynamic scaler loads, or the static scale
            if ds["dynamic"]:
                return {k: ds[k] for k in ("scale", "hysteresis_left", "iteration", "last_overflow_iteration")} | {
                    "options": {}}
            return {"scale": ds["scale"]}
        cur = current.state_dict()
        if ds["dynamic"] and "hysteresis_left" in cur:
            return {**cur, **{k: ds[k] for k in ("scale", "hysteresis_left", "iteration", "last_overflow_iteration")}}
        return cur  # another precision saved it: this run keeps its own scaler

    # -- reading -----------------------------------------------------------------------------------

    def has(self, name: str, key: str) -> bool:
        t = self.manifest["tensors"].get(name)
        if t is None:
            return False
        if t["kind"] == "buffer":
            return key == "value"
        return key == "param" or key in t.get("state", {})

    def _sources(self, name: str, key: str, want_lo: int, want_hi: int) -> list:
        """[(lo, hi, flat tensor, offset)] covering elements [want_lo, want_hi) of value `key` of
        `name`; only the ranks' files holding some of them are opened."""
        lay = self.layout
        if name in lay.pieces:
            out = []
            for lo, hi, rank, g, off in lay.pieces[name]:
                if max(lo, want_lo) >= min(hi, want_hi):
                    continue
                if key == "param":
                    src = lay.open_rank(rank)["single_partition_of_fp32_groups" if lay.stage < 3
                                              else "fp32_flat_groups"][g]
                else:
                    src = self._rank_states(rank)[g].get(key)
                    if not _elementwise(src):
                        raise DeepSpeedLayoutError(errno.EINVAL, f"deepspeed checkpoint: no optimizer state {key!r} "
                                                                 f"for {name!r} on rank {rank}",
                                                   lay.where(lay.optim_files[rank]))
                out.append((lo, hi, src.reshape(-1), off))
            return out
        if name in lay.frozen and key == "param":
            n = int(torch.Size(lay.frozen[name]).numel())
            if lay.stage < 3:
                return [(0, n, lay.frozen_fragments[name].reshape(-1), 0)]
            part = -(-n // lay.world)
            return [(r * part, min((r + 1) * part, n), lay.frozen_fragment(name, r), 0)
                    for r in range(lay.world) if max(r * part, want_lo) < min((r + 1) * part, n, want_hi)]
        if name in lay.buffers and key == "value":
            b = lay.buffers[name].reshape(-1)
            return [(0, b.numel(), b, 0)]
        raise DeepSpeedLayoutError(errno.EINVAL, f"deepspeed checkpoint: no value {key!r} of {name!r}", lay.path)

    def read_many(self, requests: list) -> list[torch.Tensor]:
        """For each (name, key, lo, hi): a CPU tensor of its flat elements [lo, hi)."""
        out = []
        for name, key, lo, hi in requests:
            sources = self._sources(name, key, lo, hi)
            dtype = sources[0][2].dtype if sources else torch.float32
            t = torch.empty(hi - lo, dtype=dtype)
            covered = 0
            for slo, shi, src, off in sources:
                a, z = max(lo, slo), min(hi, shi)
                if a >= z:
                    continue
                start = off + (a - slo)
                if start + (z - a) > src.numel():
                    raise DeepSpeedLayoutError(errno.EIO, f"deepspeed checkpoint: {name!r} ({key}) needs elements "
                                                          f"[{start}, {start + z - a}) of a partition of "
                                                          f"{src.numel()} (truncated or inconsistent files)", self.path)
                t[a - lo:z - lo].copy_(src[start:start + (z - a)])
                covered += z - a
            if covered != hi - lo:
                raise DeepSpeedLayoutError(errno.EIO, f"deepspeed checkpoint: elements [{lo}, {hi}) of {name!r} "
                                                      f"({key}) are not all in the files", self.path)
            out.append(t)
        return out
