"""The engine's module hooks as torch.compile sees them: opaque calls, never traced.

Stage 3's gather/release hooks (param_gatherer.py) swap what each parameter's .data is (its
resting view <-> the full tensor, layout.Bucket.show_full/show_resting), wait for collectives and keep
the pass's state in Python. Dynamo tracing into them bakes one side of the swap into a graph:
the gathered tensor is compiled in and the next call meets the resting view (issue 44: inductor raised
"wrong number of dimensions1"; with aot_eager the gradient reducer saw a tied parameter's
gradient twice in one backward). So every hook the engine puts on a module or on a module's
output is wrapped with torch.compiler.disable(recursive=True), as FSDP2 wraps its own
(torch/distributed/fsdp/_fully_shard/_fsdp_common.py _dynamo_disable): when a compiled region
calls one, dynamo ends the graph there, runs the hook eagerly and resumes tracing after it, with
guards on the parameters' shapes as the hook left them (full while a unit runs).

Hooks sit at unit boundaries (the call of a unit's module), so that is where compiled graphs
break; a unit's own forward stays one graph. Hooks made only of tensor operations (the
mixed-precision input cast, precision.py) stay traceable. Hooks run by the autograd engine on
parameters (post-accumulate-grad, backward_pass.py) are outside any compiled frame and are not
wrapped.
"""

from __future__ import annotations

import torch


def opaque(hook, what: str):
    """`hook`, run eagerly when a torch.compile'd region calls it (a graph break, with `what`
    as dynamo's recorded reason); a plain call otherwise."""
    return torch.compiler.disable(hook, recursive=True, reason=f"zeroplus: {what} runs eagerly")
