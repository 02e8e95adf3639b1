"""python -m zeroplus.checkpoint {consolidate PATH (OUT [--format torch|safetensors] | --output-dir DIR [--max-shard-size 5GB] [--dtype fp32|bf16|fp16] [--trainable-only] [--mode 0644]) | inspect PATH [--json] | convert --from deepspeed DS_DIR OUT
| convert --to deepspeed PATH OUT [--world-size N] [--stage 1|2|3]}

Also installed as the console script `zeroplus-checkpoint`. consolidate writes one fp32 state
dict (OUT), or with --output-dir an HF folder of sharded safetensors that from_pretrained reads.

Exit status: 0 on success (inspect: every checksum matched), 1 when inspect found a bad file,
2 on an error (the message names the file).
"""

from __future__ import annotations

import argparse
import json
import sys


def _octal_mode(text: str) -> int:
    try:
        return int(text, 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mode must be an octal permission mode like 0644, got {text!r}") from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"--world-size must be an integer >= 1, got {text!r}")
    return value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zeroplus.checkpoint", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="one fp32 state dict (torch.load(weights_only=True) or safetensors), "
                                          "or an HF folder of sharded safetensors (--output-dir)")
    c.add_argument("path", help="checkpoint directory, or a root whose 'latest' names one")
    c.add_argument("out", nargs="?", help="output file (must not exist)")
    c.add_argument("--format", choices=("torch", "safetensors"), default="torch", help="of OUT")
    c.add_argument("--output-dir", help="write an HF folder instead (must not exist): model-0000K-of-0000N."
                                        "safetensors + model.safetensors.index.json")
    c.add_argument("--max-shard-size", default="5GB", help="--output-dir: bytes per file, '5GB', '500MiB' (default 5GB)")
    c.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="--output-dir: floating tensors in this dtype (default fp32)")
    c.add_argument("--trainable-only", action="store_true",
                   help="--output-dir: only the parameters trainable when saved (PEFT adapters)")
    c.add_argument("--mode", type=_octal_mode, default=0o644, help="--output-dir: file mode, octal (default 0644)")
    i = sub.add_parser("inspect", help="source, tensors, bytes; verifies every checksum")
    i.add_argument("path")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    v = sub.add_parser("convert", help="another framework's checkpoint <-> a zeroplus checkpoint (streaming)")
    way = v.add_mutually_exclusive_group(required=True)
    way.add_argument("--from", dest="source", choices=("deepspeed",),
                     help="deepspeed: a ZeRO 1/2/3 checkpoint of DeepSpeed 0.19.8 (root with `latest`, or "
                          "global_stepN) -> a zeroplus checkpoint OUT")
    way.add_argument("--to", dest="target", choices=("deepspeed",),
                     help="deepspeed: a zeroplus checkpoint -> DeepSpeed 0.19.8's ZeRO layout in OUT (OUT/latest, "
                          "OUT/global_stepN/)")
    v.add_argument("path", help="the checkpoint to convert")
    v.add_argument("out", help="the directory to create (must not exist)")
    v.add_argument("--world-size", type=_positive_int,
                   help="--to deepspeed: DeepSpeed's data-parallel size (default: the world size the zeroplus "
                        "checkpoint was saved at)")
    v.add_argument("--stage", type=int, choices=(1, 2, 3),
                   help="--to deepspeed: DeepSpeed's ZeRO stage (default: the stage the zeroplus checkpoint was "
                        "saved at)")
    args = parser.parse_args(argv)
    if args.command == "consolidate" and (args.out is None) == (args.output_dir is None):
        parser.error("consolidate: give OUT (one file) or --output-dir DIR (an HF folder), exactly one")
    if args.command == "convert" and args.source and (args.world_size is not None or args.stage is not None):
        parser.error("convert: --world-size and --stage go with --to deepspeed (--from reads them from DS_DIR)")

    from .consolidate import consolidate, inspect  # noqa: PLC0415 - after argument errors, which need no torch

    try:
        if args.command == "convert" and args.target:
            from .deepspeed_export import convert_to_deepspeed  # noqa: PLC0415

            res = convert_to_deepspeed(args.path, args.out, world_size=args.world_size, stage=args.stage)
            print(f"wrote {args.out}: DeepSpeed ZeRO stage {res['stage']} checkpoint of {res['world_size']} ranks, "
                  f"tag {res['tag']}, {res['bytes']} bytes in {res['files']} files")
            return 0
        if args.command == "convert":
            from .deepspeed_convert import convert_from_deepspeed  # noqa: PLC0415

            res = convert_from_deepspeed(args.path, args.out)
            print(f"wrote {args.out}: {res['tensors']} tensors, {res['bytes']} bytes in {res['files']} files "
                  f"(DeepSpeed ZeRO stage {res['stage']}, {res['world_size']} ranks)")
            return 0
        if args.command == "consolidate" and args.output_dir is not None:
            res = consolidate(args.path, output_dir=args.output_dir, max_shard_size=args.max_shard_size,
                              dtype=args.dtype, trainable_only=args.trainable_only, mode=args.mode)
            print(f"wrote {args.output_dir}: {res['tensors']} tensors in {len(res['files'])} files, "
                  f"{res['bytes']} bytes ({args.dtype})")
            return 0
        if args.command == "consolidate":
            res = consolidate(args.path, args.out, args.format)
            print(f"wrote {args.out}: {res['tensors']} tensors, {res['bytes']} bytes ({args.format})")
            return 0
        res = inspect(args.path)
    except (OSError, ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        s = res["source"]
        print(f"checkpoint {res['path']} (format v{res['version']})")
        print(f"  saved by {s.get('engine')} stage {s.get('stage')}, world size {s.get('world_size')}, "
              f"mixed precision {s.get('mixed_precision')}, optimizer {s.get('optimizer_class')}")
        print(f"  {len(res['tensors'])} tensors, {res['bytes']} bytes in {len(res['files'])} files")
        for f in res["files"]:
            print(f"  {f['name']}: {f['bytes']} bytes, checksums {f['checksums']}")
        print(f"  extra: {json.dumps(res['extra'])}")
        print("OK" if res["ok"] else "CORRUPT")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
