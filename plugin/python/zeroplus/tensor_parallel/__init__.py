"""Tensor parallelism for zeroplus's ZeRO (docs/tensor_parallel.md).

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    plan = zeroplus.tensor_parallel.auto_plan(model, tp)     # inspect: print(plan.describe())
    plan.apply(model, mesh["tp"])                            # parameters become DTensors
    model, opt = zeroplus.initialize(model, torch.optim.AdamW, stage=1,
                                     process_group=mesh["dp"].get_group(), lr=3e-4)
    # or in one call: zeroplus.initialize(model, ..., stage=1, tensor_parallel=mesh)

auto.py finds the plan, plan.py applies it, styles.py holds the Conv1D styles torch lacks. The ZeRO
engine's side (local tensors, the norm over both dimensions) is zeroplus.zero.dtensor_params.
"""

from .auto import auto_plan
from .plan import TensorParallelPlan
from .styles import Conv1DColwise, Conv1DRowwise

__all__ = ["auto_plan", "Conv1DColwise", "Conv1DRowwise", "TensorParallelPlan"]
