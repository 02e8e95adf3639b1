"""Smoke test of an installed zeroplus (scripts/package_check.sh): run under torchrun with 2 ranks,
no PYTHONPATH, from outside the repository. Checks that the package and its library come from
site-packages, that a bare torch.ops.load_library(zeroplus.library_path()) works, that
backend="zeroplus" all-reduces, and that ZeroRedundancyOptimizer steps like torch's AdamW."""

import os
import sys

import torch
import torch.distributed as dist

import zeroplus

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
assert "PYTHONPATH" not in os.environ, os.environ.get("PYTHONPATH")
site = os.path.dirname(os.path.dirname(zeroplus.__file__))
assert site.endswith("site-packages"), zeroplus.__file__
assert zeroplus.library_path() == os.path.join(site, "zeroplus", "libzeroplus.so"), zeroplus.library_path()
torch.ops.load_library(zeroplus.library_path())  # idempotent; the documented bare form

dist.init_process_group("zeroplus")
t = torch.full((5,), float(rank + 1))
dist.all_reduce(t)
assert torch.equal(t, torch.full((5,), float(sum(range(1, world + 1))))), t

torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
reference = torch.nn.Linear(8, 4)
reference.load_state_dict(model.state_dict())
opt = zeroplus.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
x = torch.randn(16, 8)
for _ in range(3):
    for m, o in ((model, opt), (reference, ref_opt)):
        o.zero_grad()
        m(x).square().mean().backward()
        o.step()
for p, q in zip(model.parameters(), reference.parameters()):
    torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
dist.destroy_process_group()
print(f"rank {rank}: installed zeroplus {zeroplus.__version__} ok ({zeroplus.library_path()})", flush=True)
sys.exit(0)
