"""python -m zeroplus.estimate --params 1.3e9 --world-size 8 [--mixed-precision bf16] [--optimizer adam]
                             [--offload-optimizer nvme --buffer-count 4 --bucket-elems 4194304]
                             [--offload-param nvme --param-buffer-count 5] [--device cuda]

Prints the ZeRO model-state bytes per rank for stages 0-3 (zeroplus.estimate_memory); with
--offload-optimizer nvme also what stays in memory and what the swap files take (stages 1-3); with
--offload-param nvme the stage-3 row also moves the parameter shards to the swap files; with
--device cuda also what is in GPU and in host memory (optimizer offload of CUDA training;
--offload-param cpu|nvme moves the stage-3 parameter shards off gpu, to host or to nvme)."""

from __future__ import annotations

import argparse
import sys

from .zero.memory import estimate_memory


def _gib(x: float) -> str:
    return f"{x / 2**30:10.2f}"


def _description() -> str:
    # The module docstring opens with the usage lines (argparse prints its own usage); the
    # description is the paragraph after them.
    return " ".join(__doc__.split("\n\n", 1)[1].split())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zeroplus.estimate", description=_description())
    parser.add_argument("--params", type=float, required=True, help="number of parameters (1.3e9)")
    parser.add_argument("--world-size", type=int, required=True, help="data-parallel ranks")
    parser.add_argument("--mixed-precision", choices=["bf16", "fp16", "none"], default="bf16",
                        help="compute dtype (default bf16; 'none' for fp32 training, as --fp32)")
    parser.add_argument("--fp32", action="store_true", help="fp32 training (no master copy); same as --mixed-precision none")
    parser.add_argument("--optimizer", default="adam", help="adam | adamw | sgd | sgd_nomomentum | adagrad")
    parser.add_argument("--offload-optimizer", choices=["none", "cpu", "nvme"], default="none",
                        help="optimizer offload (docs/offload.md); nvme adds the resident and nvme columns")
    parser.add_argument("--buffer-count", type=int, default=4, help="offload_optimizer.buffer_count")
    parser.add_argument("--offload-param", choices=["none", "cpu", "nvme"], default="none",
                        help="stage-3 parameter offload (docs/offload.md)")
    parser.add_argument("--param-buffer-count", type=int, default=5, help="offload_param.buffer_count")
    parser.add_argument("--param-buffer-size", type=int, default=100_000_000,
                        help="offload_param.buffer_size (elements per pool buffer; DeepSpeed's 1e8)")
    parser.add_argument("--bucket-elems", type=int, default=1 << 22,
                        help="elements per bucket (reduce_bucket_size; stage 3: the largest gather unit)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where training runs (cuda: gpu and host columns)")
    args = parser.parse_args(argv)
    precision = None if args.fp32 or args.mixed_precision == "none" else args.mixed_precision
    offload = args.offload_optimizer

    def row(stage):
        return estimate_memory(args.params, args.world_size, stage, precision, args.optimizer,
                               offload if stage else "none", args.buffer_count, args.bucket_elems,
                               args.offload_param if stage == 3 else "none", args.param_buffer_count,
                               args.param_buffer_size, args.device)
    try:
        rows = [(s, row(s)) for s in range(4)]
    except ValueError as e:
        parser.error(str(e))
    print(f"model-state GiB per rank: {args.params:.3g} parameters, {args.world_size} ranks, "
          f"{precision or 'fp32'}, {args.optimizer}")
    extra = offload == "nvme" or args.offload_param == "nvme"
    cuda = args.device == "cuda"
    print(f"{'stage':>5} {'params':>10} {'grads':>10} {'master':>10} {'optim':>10} {'total':>10}"
          + (f" {'resident':>10} {'nvme':>10}" if extra else "") + (f" {'gpu':>10} {'host':>10}" if cuda else ""))
    for s, r in rows:
        print(f"{s:>5} {_gib(r['parameters'])} {_gib(r['gradients'])} {_gib(r['master_parameters'])} "
              f"{_gib(r['optimizer_state'])} {_gib(r['model_state'])}"
              + (f" {_gib(r['resident'])} {_gib(r['nvme'])}" if extra else "")
              + (f" {_gib(r['gpu'])} {_gib(r['host'])}" if cuda else ""))
    if extra:
        print("resident: model state left in memory + the swappers' buffers; nvme: swap files on disk "
              "(stage 0 has no offload; offload_param applies to stage 3 only)")
    if cuda:
        print("gpu: GPU memory; host: host memory (offload_optimizer on CUDA: the fp32 master, in every precision, "
              "and the state or the swapper's buffers, plus staging and the gradient shards; the gpu keeps one "
              "bucket's gradient on its way down)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
