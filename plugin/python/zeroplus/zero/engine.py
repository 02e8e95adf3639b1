"""The ZeRO engine of stages 1-3: sharded optimizer state behind a torch.optim.Optimizer.

ZeroEngine is composed of one owner per concern; the stage classes (stages.py) only choose them:

    layout.py            flat buckets: every trainable parameter becomes a view into a flat buffer
    replicated_params.py stages 1-2: parameters whole on every rank, all-gathered after each step
    sharded_params.py    stage 3: parameters sharded, gathered unit by unit (param_gatherer.py)
    grad_reducer.py      hooks + overlapped reduce-scatter (all-reduce at stage 1); gradient shards
    backward_pass.py     the one owner of backward hooks and of the end-of-backward callback
    loss_scaler.py       fp16 dynamic loss scaling (DeepSpeed rules, the C++ core's scaler)
    clipping.py          global norm across shards
    grad_views.py        p.grad after backward (views of the reduced gradient for torch's clip functions)
    usage.py             which parameters had a gradient (agreed at step)
    unoptimized_grads.py trainable parameters in no param group: gradients averaged as under DDP
    bucket_optimizer.py  one bucket's step over its segments (fetch -> step -> store)
    state.py             sharded and consolidated (plain torch.optim) state dicts
    state_dict_guard.py  stage 3: model.state_dict() of shards raises; torch's DCP calls on the engine raise
    this file            construction order, the step (unscale, clip, the bucket loop), zero_grad

The user's param_groups stay the user's (LR schedulers and hyperparameter edits work). Each
bucket has an fp32 master of this rank's shard and a BucketOptimizer (bucket_optimizer.py): the
user's class, or zeroplus's fused twin for Adam/AdamW/SGD, over one view of the master per
parameter piece ("segment"), so each parameter keeps its own state and step count and a parameter
no rank gave a gradient is not updated at all (usage.py). step() walks the buckets: fetch, step,
store, then the placement publishes the new values (an all-gather overlapping the next bucket's
step at stages 1-2; this rank's shard at stage 3). With offload_optimizer on CUDA training the
masters are the host tier's (zeroplus.offload.host_tier): it observes the reducer, so gradient
shards start down to the host during backward as each bucket's reduction is settled (the rest a
few buckets ahead of the step, host_tier.gradient), the step runs on the CPU, and publish copies
the new master up (write_master_into) before the bucket's all-gather.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.distributed as dist

from ..offload import attach_optimizer_store, make_host_tier, prepare_optimizer_store, prepare_param_store
from ..optim.fused import fused_class_for
from . import clipping, dtensor_params, full_state, module_methods, precision, state, state_dict_guard
from .grad_views import GradViews
from .backward_pass import BackwardPass
from .bucket_optimizer import BucketOptimizer
from .grad_reducer import GradientReducer
from .loss_scaler import DynamicLossScaler, LossScalerOptions, StaticLossScaler
from .memory import optimizer_bytes
from .unoptimized_grads import UnoptimizedGrads
from .policies import EngineOptions

_UNSUPPORTED_OPTIONS = ("differentiable",)  # masters are not part of an autograd graph


class ZeroEngine(torch.optim.Optimizer):
    stage: int  # set by the stage classes (stages.py)

    def __init__(self, params, optimizer_class, *, options: EngineOptions | None = None, process_group=None,
                 module=None, **defaults):
        """params and defaults as torch.optim takes them; options: the policies (policies.py),
        defaults when None; module: the model (needed by stage 3, and for buffers, mixed-precision
        input casts and model.no_sync() at stages 1-2)."""
        if type(self) is ZeroEngine:
            raise TypeError("ZeroEngine is built through a stage class: Stage1Optimizer, Stage2Optimizer or "
                            "Stage3Optimizer (or zeroplus.initialize)")
        name = type(self).__name__
        options = EngineOptions() if options is None else options
        if not isinstance(options, EngineOptions):
            raise TypeError(f"{name}: options must be a zeroplus.zero.EngineOptions, got {type(options).__name__}")
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"{name}: optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}")
        for key in _UNSUPPORTED_OPTIONS:
            if defaults.get(key):
                raise ValueError(f"{name}: optimizer option {key}=True is not supported by ZeRO stage {self.stage}")
        if not dist.is_initialized():
            raise RuntimeError(f"{name}: torch.distributed is not initialized; call init_process_group first")
        if module is not None and not isinstance(module, torch.nn.Module):
            raise TypeError(f"{name}: module must be a torch.nn.Module, got {type(module).__name__}")

        self._constructing = True
        super().__init__(params, defaults)
        self._constructing = False
        self.options = options
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        precision_policy = options.precision
        self.mixed_precision = precision_policy.mixed_precision
        self.compute_dtype = precision_policy.compute_dtype
        self.module = module
        self.gradient_clipping = float(options.gradient_clipping)
        self._check_params(name)
        self._check_hyperparameters(name, optimizer_class)
        # Tensor-parallel (DTensor) parameters: the engine works on their local tensors over
        # process_group, the data-parallel group (dtensor_params.py); None without any.
        all_params = [p for g in self.param_groups for p in g["params"]]
        if self.stage == 3 and any(dtensor_params.is_dtensor(p) for p in all_params):
            raise ValueError(f"{name}: ZeRO stage 3 does not take tensor-parallel (DTensor) parameters (params): it "
                             f"shards and gathers whole parameters itself; use stage=1 or stage=2 with the mesh's 'dp' "
                             f"group as process_group")
        self.tp_group = dtensor_params.tensor_parallel_group(name, all_params, process_group)

        trainable = [[p for p in g["params"] if p.requires_grad] for g in self.param_groups]
        if not any(trainable):
            raise ValueError(f"{name}: params has no parameter with requires_grad=True")
        self.placement = self._make_placement(options)
        self.placement.check_module(name, trainable)
        # Offload settings are checked and the swap directory made before anything is changed.
        device = self.placement.target_device or next(p.device for grp in trainable for p in grp)
        self._offload_prepared = prepare_optimizer_store(options.offload_optimizer, options.offload_param, self.rank,
                                                         device, name)
        param_store = prepare_param_store(options.offload_param, self.stage, self.rank, device, name,
                                          self._offload_prepared)
        if param_store is not None:
            self.placement.use_param_store(param_store)
        if self.compute_dtype is not None and module is not None:
            precision.cast_buffers(module, self.compute_dtype)
        self.buckets = self.placement.plan_layout(trainable, options.reduce_bucket_elems)
        self.masters = self.placement.build_flat_buffers()
        # offload_optimizer on CUDA training: the masters (and so the optimizer state) move to
        # host memory; the step runs there (zeroplus.offload.host_tier). None otherwise.
        self.host_tier = make_host_tier(self._offload_prepared, self.buckets[0].device, self.masters)
        if self.host_tier is not None:
            self.masters = self.host_tier.masters
        self.placement.sync_unmanaged(trainable)
        self._build_inner(optimizer_class)
        self.reducer = GradientReducer(self.buckets, process_group, self.world_size, self.rank,
                                       precision_policy.grad_accum_dtype, shard_gradients=self.stage >= 2)
        if self.host_tier is not None:  # gradient shards start down to the host as backward reduces them
            self.reducer.attach_observer(self.host_tier)
        # The one owner of backward-pass hooks and of the end-of-backward callback; the reducer
        # is its first participant (stage 3 attaches the gatherer after it).
        self.backward_pass = BackwardPass()
        self.backward_pass.attach(self.reducer, list(self.reducer.slot))
        if self.mixed_precision == "fp16":
            static = precision_policy.static_loss_scale
            self.scaler = (StaticLossScaler() if static is not None
                           else DynamicLossScaler(precision_policy.loss_scaler or LossScalerOptions()))
            if static is not None:
                self.scaler.scale = float(static)
        else:
            self.scaler = StaticLossScaler()
        self._clipped_this_step = False
        self._externally_unscaled = False  # zeroplus.GradScaler.unscale_ ran for this step
        self.skipped_steps = 0
        self._consolidated = None
        self._input_cast = None
        if module is not None:
            if self.compute_dtype is not None:
                self._input_cast = precision.install_input_cast(module, self.compute_dtype)
            module_methods.install(self, module)  # model.no_sync() and model.zero_grad(), as under DDP
        self._finish_construction()

    # -- construction --------------------------------------------------------------------------

    def _check_params(self, name: str) -> None:
        devices = {p.device for g in self.param_groups for p in g["params"]}
        if len(devices) > 1:
            raise ValueError(f"{name}: params are on several devices {sorted(map(str, devices))}; ZeRO stage "
                             f"{self.stage} needs every parameter on one device")
        for g in self.param_groups:
            for p in g["params"]:
                if getattr(p, "_zeroplus_managed", False):
                    raise ValueError(f"{name}: a parameter of shape {tuple(p.shape)} is already managed by another "
                                     f"zeroplus ZeRO optimizer")
                if p.requires_grad and not p.is_floating_point():
                    raise TypeError(f"{name}: trainable parameter of dtype {p.dtype} is not floating point")
                if p.requires_grad and (p.is_sparse or p.layout is not torch.strided):
                    raise ValueError(f"{name}: parameter layout {p.layout} is not supported (dense tensors only)")

    def _check_hyperparameters(self, name: str, optimizer_class) -> None:
        """Let the optimizer class judge the hyperparameters (keyword arguments, as the user's own
        `optimizer_class(params, **defaults)` would take them) on a scratch parameter before any
        parameter is cast, flattened or hooked: torch's TypeError/ValueError, naming the argument,
        then leaves the user's model untouched."""
        try:
            optimizer_class([torch.nn.Parameter(torch.zeros(1))], **self.defaults)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{name}: {optimizer_class.__name__} rejects the hyperparameters: {e}") from e

    def _make_placement(self, options: EngineOptions):
        """Where parameters live: ReplicatedParams (stages 1-2) or ShardedParams (stage 3)."""
        raise NotImplementedError

    def _finish_construction(self) -> None:
        """Set-up after the reducer exists: the placement's part (stage 3: the parameter
        gatherer), then the model's load hooks."""
        self.placement.attach()
        # Trainable parameters in no group: never stepped, their gradients averaged as DDP does
        # (it only reads .grad at the end of the backward).
        left_out = UnoptimizedGrads.left_out(self.module, self.param_groups)
        if left_out:
            shapes = {id(e.param): e.shape for b in self.placement.frozen_buckets for e in b.entries}
            self.backward_pass.attach(UnoptimizedGrads(left_out, shapes, self.reducer, self.process_group,
                                                       self.world_size), left_out)
        # p.grad after each backward, for torch's clip_grad_norm_ and gradient reads (grad_views.py);
        # attached last: it ends a pass after the reducer reduced and the gatherer released.
        self.grad_views = GradViews(self)
        self.backward_pass.attach(self.grad_views, [])
        if self.module is not None:
            full_state.install_load_hooks(self)
            if self.placement.gatherer is not None:  # stage 3: state_dict() of shards raises
                state_dict_guard.install(self)
            # A weak reference: a deepcopy of the model (an EMA copy) must not copy the optimizer.
            object.__setattr__(self.module, "_zeroplus_engine", weakref.ref(self))

    def _build_inner(self, optimizer_class) -> None:
        """One BucketOptimizer per bucket: the user's optimizer class (or its fused twin) over
        this rank's segments of the bucket, with the hyperparameters of the bucket's group."""
        inner_class = fused_class_for(optimizer_class) or optimizer_class
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        param_store = getattr(self.placement, "param_store", None)  # stage 3's offload_param
        self.bucket_optimizers = [BucketOptimizer(b, master, self.rank, inner_class, hyper[b.group],
                                                  shard_in_param_record=param_store is not None
                                                  and param_store.offloads(b))
                                  for b, master in zip(self.buckets, self.masters)]
        # Offload (zeroplus.offload): a store behind every bucket's fetch/store, or None.
        self.offload = attach_optimizer_store(self._offload_prepared, self.bucket_optimizers)
        self._offload_steps = 0  # steps taken with the store (the order alternates)
        self.step_order = list(range(len(self.bucket_optimizers)))  # bucket order of the last step
        # The user's groups show every hyperparameter the optimizer fills in, as torch's do (taken
        # from a scratch instance: a group may have no segment on this rank).
        for g, h in zip(self.param_groups, hyper):
            scratch = inner_class([{**h, "params": [torch.zeros(1)]}])
            for k, v in scratch.param_groups[0].items():
                if k != "params":
                    g.setdefault(k, v)
        self.defaults = {**scratch.defaults, **self.defaults}

    def add_param_group(self, param_group) -> None:
        if getattr(self, "_constructing", False):
            return super().add_param_group(param_group)
        raise NotImplementedError(f"{type(self).__name__}: add_param_group after construction is not supported at "
                                  f"ZeRO stage {self.stage} (the flat layout is fixed); pass every group up front")

    # -- accumulation and backward -------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no communication) until the first backward after the
        block, like DistributedDataParallel.no_sync."""
        old = self.reducer.no_sync
        self.reducer.no_sync = True
        try:
            yield
        finally:
            self.reducer.no_sync = old

    @property
    def loss_scale(self) -> float:
        return float(self.scaler.scale)

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """loss.backward(), scaled by the loss scale for fp16."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"{type(self).__name__}.backward: loss must be a tensor, got {type(loss).__name__}")
        if loss.numel() != 1:
            raise ValueError(f"{type(self).__name__}.backward: loss must have one element, got shape {tuple(loss.shape)}")
        if self.mixed_precision == "fp16":
            (loss.float() * self.scaler.scale).backward(**kwargs)
        else:
            loss.backward(**kwargs)

    def gradient_shards(self) -> list[torch.Tensor]:
        """This rank's gradient shard per bucket (after backward; scaled by loss_scale for fp16).
        With offload_param "nvme" the spilled ones are read back: host copies the caller owns (they
        outlive the step, the next backward and close; writing them changes nothing the step reads), all at once. With the
        host tier the copies made in backward are dropped (the caller may write the shards; the
        step copies them again)."""
        self._flush()
        if self.host_tier is not None:
            self.host_tier.discard()
        return self.reducer.shards

    def _flush(self) -> None:
        """Close a backward pass that raised, then reduce what no_sync accumulated (collective)."""
        self.backward_pass.close_stale()
        self.reducer.flush()

    # -- clipping and step ---------------------------------------------------------------------

    def _grad_scale(self) -> float:
        """What the gradient shards are multiplied by right now."""
        return 1.0 if self._externally_unscaled else float(self.scaler.scale)

    @torch.no_grad()
    def _unscale_external(self, inv_scale: float) -> bool:
        """zeroplus.GradScaler's unscale_: multiply the shards, agree on inf/NaN. Collective."""
        self._flush()
        self.reducer.scale_(inv_scale)
        self._externally_unscaled = True
        return self._overflow()

    def _skip_step(self) -> None:
        """zeroplus.GradScaler found an overflow: no update; gradients stay until zero_grad."""
        self.skipped_steps += 1
        self._externally_unscaled = False
        self._clipped_this_step = False

    def _overflow(self) -> bool:
        """Inf/NaN in any rank's gradient shard, agreed across ranks (one allreduce)."""
        device = self.buckets[0].device
        local = torch.zeros((), dtype=torch.float32, device=device)
        if not self.reducer.all_finite():
            local.fill_(1.0)
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.process_group)
        if self.tp_group is not None:  # every rank of the mesh skips the same steps
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.tp_group)
        return bool(local.item())

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the global gradient norm across all shards; returns the norm before clipping
        (what torch.nn.utils.clip_grad_norm_ returns on the unsharded model). Collective."""
        max_norm = clipping.check_norm_args(max_norm, norm_type)
        self._flush()
        norm_type = float(norm_type)
        terms = self.reducer.local_terms(norm_type, lambda s: clipping.local_term(s, norm_type))
        total = clipping.global_norm_of_terms(terms, norm_type, self.process_group, self.buckets[0].device,
                                              [b.tp_sharded for b in self.buckets], self.tp_group)
        total = total / self._grad_scale()
        if not torch.isfinite(total):
            if error_if_nonfinite:
                raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
                                   f"non-finite, so it cannot be clipped. To disable this error and scale the "
                                   f"gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
            if self.mixed_precision == "fp16" or self._externally_unscaled:  # an overflow: the step is skipped
                self._clipped_this_step = True
                return total
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        self.reducer.scale_(coef)
        self._clipped_this_step = True
        return total

    @torch.no_grad()
    def step(self, closure=None):
        if state_dict_guard.called_by_torch_dcp():
            return None  # DCP's state initialisation (zero grads, lr 0): its state_dict() call raises next
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_param_homes()
        self._flush()
        self._consolidated = None
        usage = self.reducer.usage
        # Which parameters this step updates (one small collective). Without a backward since
        # zero_grad no rank has anything to agree on (every rank runs the same passes).
        stepped = usage.agree(self.process_group) if self.reducer.has_grads else usage.defined()
        if not any(stepped):
            return loss  # every grad None: torch's step changes nothing either
        external = self._externally_unscaled
        if self.mixed_precision == "fp16" and not external and self._overflow():
            self.scaler.update(True)
            self.skipped_steps += 1
            self.reducer.zero(set_to_none=False)
            usage.clear(set_to_none=False)
            self._clipped_this_step = False
            return loss
        if self.gradient_clipping > 0 and not self._clipped_this_step:
            self.clip_grad_norm_(self.gradient_clipping)
        self._step_buckets(stepped, 1.0 / self._grad_scale())
        if not external:
            self.scaler.update(False)
        self._clipped_this_step = False
        self._externally_unscaled = False
        return loss

    def _check_param_homes(self) -> None:
        """Every managed parameter still views the engine's buffers (see Bucket.stray_param)."""
        for b in self.buckets:
            stray = b.stray_param()
            if stray is not None:
                names = {id(p): n for n, p in self.module.named_parameters()} if self.module is not None else {}
                name = names.get(id(stray), f"of shape {tuple(stray.shape)}")
                raise RuntimeError(
                    f"{type(self).__name__}.step: parameter {name} no longer lives in zeroplus's buffers: the model "
                    f"was moved or its parameters replaced after zeroplus.initialize (model.to(...), "
                    f"param.data = ...), so the step could not update it; move the model before initialize")

    def _step_buckets(self, stepped: list[bool], inv_scale: float) -> None:
        """Bucket by bucket: fetch, step, store, then write the new master back into the
        parameters and start the bucket's all-gather, which runs while the next bucket steps.
        Hyperparameters are checked for every bucket first, so a bad one changes nothing."""
        groups = self.param_groups
        for bo in self.bucket_optimizers:
            bo.check(groups[bo.bucket.group], bo.bucket.group)
        self.placement.before_publish()
        base = self.reducer.usage.base
        works = []
        order = list(range(len(self.bucket_optimizers)))
        if self.offload is not None:
            order = self._offload_order()
            self._offload_steps += 1
            self.offload.begin_step(order)
        self.step_order = order
        # Spilled gradients (offload_param "nvme") are host tensors read back by the placement
        # (read ahead, a read error deferred to end_step): the host tier copies only device ones.
        spill = self.reducer.spill
        spilled = set() if spill is None else {i for i in order if spill.spills(i)}
        if self.host_tier is not None:  # shards not copied in backward start down, a few buckets ahead
            self.host_tier.begin_step([i for i in order if i not in spilled], self.reducer.shard)
        try:
            for i in order:
                bo = self.bucket_optimizers[i]
                if not self.placement.before_bucket_step(i):
                    continue  # an offloaded parameter shard could not be read: not stepped
                grad_shard = (self.host_tier.gradient(i) if self.host_tier is not None and i not in spilled
                              else self.placement.gradient_shard(i, self.reducer))
                if grad_shard is None:
                    continue  # a spilled gradient that could not be read: not stepped (raised at the end)
                bo.fetch()
                bo.step(grad_shard, stepped, base[i], inv_scale, groups[bo.bucket.group])
                del grad_shard
                self.reducer.release_shard(i)
                bo.store()
                work = self.placement.publish(i)
                if work is not None:
                    works.append(work)
            for w in works:
                w.wait()
        finally:
            # After the step's last collective: waits for the writes and raises a swap error
            # (every rank finished the step, so none is left waiting in a collective).
            try:
                if self.host_tier is not None:
                    self.host_tier.end_step()
                if self.offload is not None:
                    self.offload.end_step()
            finally:
                self.placement.end_step()

    def _offload_order(self) -> list[int]:
        """The bucket order of the next step with an offload store. Every other step in reverse:
        the records the last step wrote last are still in the swapper's pool and are the first
        this step needs (results do not depend on the order: buckets step independently)."""
        order = list(range(len(self.bucket_optimizers)))
        if self._offload_steps % 2:
            order.reverse()
        return order

    def write_master_into(self, i: int, dst: torch.Tensor) -> None:
        """Bucket i's master into dst, this rank's shard of its parameters (the placements'
        publish): through the host tier (an asynchronous host-to-device copy that the compute
        stream waits for), or a copy in memory where the master is not dst itself."""
        if self.host_tier is not None:
            self.host_tier.upload(i, dst)
        elif self.masters[i].data_ptr() != dst.data_ptr():
            dst.copy_(self.masters[i])

    @torch.no_grad()
    def publish_masters(self) -> None:
        """Write every rank's masters into the parameters, as the end of step() does (collective).
        For code that changed masters outside step(): zeroplus.load_checkpoint."""
        self._consolidated = None
        self.placement.before_publish()
        works = []
        for i, bo in enumerate(self.bucket_optimizers):
            with bo.resident_master():  # a master swapped out by offload_optimizer: read back for this
                work = self.placement.publish(i)
            if work is not None:
                works.append(work)
        for w in works:
            w.wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.offload is not None:  # the next step's records are read during forward and backward
            self.offload.plan(self._offload_order())
        self.backward_pass.close_stale()
        self.reducer.zero(set_to_none)
        self.reducer.usage.clear(set_to_none)
        self._clipped_this_step = False
        self._externally_unscaled = False
        if set_to_none:
            self.grad_views.forget()
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.zero_()
        if not set_to_none:
            self.grad_views.expose()  # zeros, as torch's zero_grad(set_to_none=False) leaves them

    # -- state ---------------------------------------------------------------------------------

    def state_dict(self):
        state_dict_guard.refuse_torch_dcp("state_dict()")
        if self._consolidated is not None:
            return self._consolidated
        return state.sharded_state_dict(self)

    def load_state_dict(self, state_dict) -> None:
        """Validates and stages everything (swap records to side files), then changes it; on any
        error nothing has changed (state.stage_load). Refused when torch's DCP calls it
        (state_dict_guard: use zeroplus.checkpoint.set_state_dict)."""
        state_dict_guard.refuse_torch_dcp("load_state_dict()")
        staged = self.stage_load(state_dict)
        try:
            self.commit_load(staged)
        finally:
            self.discard_load(staged)

    def stage_load(self, state_dict, streamed=None, owned: bool = False) -> "state.StagedLoad":
        """The first half of load_state_dict (also load_checkpoint's, with `streamed` buckets read
        one at a time): changes nothing. torch.optim.Optimizer.load_state_dict's pre-hooks
        (register_load_state_dict_pre_hook), which this override would otherwise skip, run here:
        a pre-hook may return a new dict. owned=True: the state's tensors were made for this load
        (load_checkpoint read them) and are taken as they are, not copied."""
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict, owned = result, False  # the hook's dict may hold the caller's tensors
        return state.stage_load(self, state_dict, streamed, owned=owned)

    def commit_load(self, staged: "state.StagedLoad") -> None:
        state.commit_load(self, staged)
        self._consolidated = None
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def discard_load(self, staged: "state.StagedLoad") -> None:
        state.discard_load(self, staged)

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the full optimizer state in plain torch.optim format on group rank `to`; its
        next state_dict() returns it (until the next step). Collective."""
        if isinstance(to, bool) or not isinstance(to, int) or not 0 <= to < self.world_size:
            raise ValueError(f"consolidate_state_dict: to must be a rank in [0, {self.world_size}), got {to!r}")
        full = state.consolidated_state_dict(self)
        self._consolidated = full if self.rank == to else None

    def memory_bytes(self) -> dict[str, int]:
        return self.placement.add_memory(optimizer_bytes(self))
