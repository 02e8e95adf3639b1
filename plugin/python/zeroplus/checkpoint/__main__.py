"""python -m zeroplus.checkpoint {consolidate PATH OUT [--format torch|safetensors] | inspect PATH [--json] | convert --from deepspeed DS_DIR OUT}

Exit status: 0 on success (inspect: every checksum matched), 1 when inspect found a bad file,
2 on an error (the message names the file).
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zeroplus.checkpoint", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="one fp32 state dict (torch.load(weights_only=True) or safetensors)")
    c.add_argument("path", help="checkpoint directory, or a root whose 'latest' names one")
    c.add_argument("out", help="output file (must not exist)")
    c.add_argument("--format", choices=("torch", "safetensors"), default="torch")
    i = sub.add_parser("inspect", help="source, tensors, bytes; verifies every checksum")
    i.add_argument("path")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    v = sub.add_parser("convert", help="another framework's checkpoint -> a zeroplus checkpoint (streaming)")
    v.add_argument("--from", dest="source", choices=("deepspeed",), required=True,
                   help="deepspeed: a ZeRO 1/2/3 checkpoint of DeepSpeed 0.19.8 (root with `latest`, or global_stepN)")
    v.add_argument("path", help="the checkpoint to convert")
    v.add_argument("out", help="the zeroplus checkpoint directory to create (must not exist)")
    args = parser.parse_args(argv)

    from .consolidate import consolidate, inspect  # noqa: PLC0415 - after argument errors, which need no torch

    try:
        if args.command == "convert":
            from .deepspeed_convert import convert_from_deepspeed  # noqa: PLC0415

            res = convert_from_deepspeed(args.path, args.out)
            print(f"wrote {args.out}: {res['tensors']} tensors, {res['bytes']} bytes in {res['files']} files "
                  f"(DeepSpeed ZeRO stage {res['stage']}, {res['world_size']} ranks)")
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
