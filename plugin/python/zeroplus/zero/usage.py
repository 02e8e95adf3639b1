"""Which parameters a step updates: torch.optim's and DDP's rule for parameters without a gradient.

The reference is DistributedDataParallel(find_unused_parameters=True) + the same torch optimizer:
  * torch.optim skips a parameter whose .grad is None: no weight decay, no moment change, no step
    count (each parameter keeps its own);
  * DDP leaves the gradient of a parameter that no rank used untouched (None after
    zero_grad(set_to_none=True), the old zero tensor after set_to_none=False) and averages one used
    on some ranks only with zeros from the others.
The ZeRO engines free p.grad as soon as it is copied into a bucket, so "this parameter had a
gradient" is recorded here instead, one flag per trainable parameter (its bucket entry):

  * the gradient reducer marks the flags of a backward pass once that pass's collectives all
    succeeded (`commit`): a gradient a backward produced, or one accumulated under no_sync and
    sent later;
  * `agree(group)` at step: one all_reduce(MAX) of one byte per parameter, so "used" means used on
    any rank, and every rank steps the same parameters;
  * a parameter is stepped when its gradient is defined: used since the last zero_grad, or kept
    as a (zero) tensor by zero_grad(set_to_none=False) after an earlier step used it.

Threading: called from the autograd thread (commit) and the training thread (everything else),
never concurrently (the engines run backward and step one after the other).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class ParamUsage:
    def __init__(self, counts: list[int], device: torch.device):
        """counts[b]: number of entries of bucket b; flag of (b, e) is base[b] + e."""
        self.base = []
        total = 0
        for n in counts:
            self.base.append(total)
            total += n
        self.device = device
        self._used = bytearray(total)     # this rank, since the last zero_grad
        self._defined = bytearray(total)  # agreed: a gradient exists (stepped by the next step)

    def __len__(self) -> int:
        return len(self._used)

    def flag(self, bucket: int, entry: int) -> int:
        return self.base[bucket] + entry

    def commit(self, flags) -> None:
        used = self._used
        for f in flags:
            used[f] = 1

    def agree(self, group) -> list[bool]:
        """Collective (every rank calls it at the same step): marks every parameter used on any
        rank as defined and returns, per flag, whether the step updates it."""
        if len(self._used):
            if self.device.type == "cpu":
                flags = torch.frombuffer(bytearray(self._used), dtype=torch.uint8)
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
                agreed = flags.numpy().tobytes()
            else:
                flags = torch.tensor(list(self._used), dtype=torch.uint8, device=self.device)
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
                agreed = bytes(flags.cpu().tolist())
            defined = self._defined
            for i, used in enumerate(agreed):
                if used:
                    defined[i] = 1
        return self.defined()

    def defined(self) -> list[bool]:
        return [bool(d) for d in self._defined]

    def clear(self, set_to_none: bool) -> None:
        """zero_grad: gradients are gone (set_to_none) or zero tensors that still exist."""
        self._used = bytearray(len(self._used))
        if set_to_none:
            self._defined = bytearray(len(self._defined))

    def state_dict(self) -> list[int]:
        return list(self._defined)
