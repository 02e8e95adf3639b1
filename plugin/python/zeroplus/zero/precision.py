"""Mixed precision for the ZeRO engines: the model computes in bf16/fp16, masters stay fp32.

Like DeepSpeed's bf16/fp16 modes (and unlike autocast) the parameters themselves are stored in
the low-precision dtype, which is where ZeRO's 2-byte-per-parameter figures come from. Floating
buffers follow the parameters (DeepSpeed casts the whole module); a forward pre-hook on the root
module casts floating-point inputs, as FSDP's MixedPrecision(cast_forward_inputs=True) does, so a
model fed fp32 features does not fail on a dtype mismatch.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

# mixed_precision= values and the compute dtype each stands for (None: fp32 training).
COMPUTE_DTYPES = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}


def cast_buffers(module: torch.nn.Module, dtype: torch.dtype) -> None:
    for sub in module.modules():
        for name, buf in sub.named_buffers(recurse=False):
            if buf is not None and buf.is_floating_point() and buf.dtype != dtype:
                setattr(sub, name, buf.to(dtype))


def install_input_cast(module: torch.nn.Module, dtype: torch.dtype):
    def cast(x):
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype else x

    def hook(_module, args, kwargs):
        return tree_map(cast, args), tree_map(cast, kwargs)

    return module.register_forward_pre_hook(hook, with_kwargs=True)
