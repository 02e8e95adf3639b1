"""python -m zeroplus.estimate --params 1.3e9 --world-size 8 [--mixed-precision bf16] [--optimizer adam]

Prints the ZeRO model-state bytes per rank for stages 0-3 (zeroplus.estimate_memory)."""

from __future__ import annotations

import argparse
import sys

from .zero.memory import estimate_memory


def _gib(x: float) -> str:
    return f"{x / 2**30:10.2f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zeroplus.estimate", description=__doc__.splitlines()[2])
    parser.add_argument("--params", type=float, required=True, help="number of parameters (1.3e9)")
    parser.add_argument("--world-size", type=int, required=True, help="data-parallel ranks")
    parser.add_argument("--mixed-precision", choices=["bf16", "fp16"], default="bf16",
                        help="compute dtype (default bf16; 'none' for fp32 training)")
    parser.add_argument("--fp32", action="store_true", help="fp32 training (no master copy)")
    parser.add_argument("--optimizer", default="adam", help="adam | adamw | sgd | sgd_nomomentum | adagrad")
    args = parser.parse_args(argv)
    precision = None if args.fp32 else args.mixed_precision
    try:
        rows = [(s, estimate_memory(args.params, args.world_size, s, precision, args.optimizer)) for s in range(4)]
    except ValueError as e:
        parser.error(str(e))
    print(f"model-state GiB per rank: {args.params:.3g} parameters, {args.world_size} ranks, "
          f"{precision or 'fp32'}, {args.optimizer}")
    print(f"{'stage':>5} {'params':>10} {'grads':>10} {'master':>10} {'optim':>10} {'total':>10}")
    for s, r in rows:
        print(f"{s:>5} {_gib(r['parameters'])} {_gib(r['gradients'])} {_gib(r['master_parameters'])} "
              f"{_gib(r['optimizer_state'])} {_gib(r['model_state'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
