#!/usr/bin/env bash
# Same-machine A/B of two builds of zeroplus: bench_stages.py (DDP + AdamW, zeroplus stages 1-2,
# zeroplus backend, 2 ranks) launched alternately from each tree, LAUNCHES times each, then the
# median over launches of each variant's DDP+AdamW/this ratio and of new/old step time.
#   bash bench/zero/ab.sh OLD_TREE NEW_TREE [fp32|bf16] [LAUNCHES]
# Each tree is a built checkout (bash scripts/build.sh in it; e.g. `git worktree add /tmp/old <commit>`).
# Alternating launches spread the machine's drift over both sides; compare ratios, not absolute ms.
set -euo pipefail
old="$(cd "$1" && pwd)"; new="$(cd "$2" && pwd)"
precision="${3:-fp32}"; launches="${4:-4}"
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
py="${ZEROPLUS_PYTHON:-$repo_root/.venv/bin/python}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
for i in $(seq 1 "$launches"); do
  for side in old new; do
    tree="${!side}"
    (cd "$tree" && ZEROPLUS_BUILD_DIR="$tree/build" PYTHONPATH="$tree/plugin/python" "$py" bench/zero/bench_stages.py \
       --backends zeroplus --precision "$precision" --steps "${STEPS:-30}" \
       --variants ddp_adamw,zeroplus_stage1,zeroplus_stage2 --out "$out/${side}_$i" >/dev/null)
  done
done
"$py" - "$out" "$launches" "$precision" <<'PY'
import json, statistics, sys
out, n, precision = sys.argv[1], int(sys.argv[2]), sys.argv[3]
runs = {s: [json.load(open(f"{out}/{s}_{i}.json")) for i in range(1, n + 1)] for s in ("old", "new")}
def step_ms(run, variant):
    for backend, name, ms, *_ in run["rows"]:  # bench_stages.py's row tuples
        if backend == "zeroplus" and name == variant:
            return ms
    raise KeyError(variant)
print(f"{precision}: median over {n} launches (each a median of interleaved steps)")
print("| variant | old DDP/this | new DDP/this | change | new/old step time per launch |")
print("|---|---:|---:|---:|---|")
for v in ("zeroplus_stage1", "zeroplus_stage2"):
    r = {s: statistics.median(step_ms(run, "ddp_adamw") / step_ms(run, v) for run in runs[s]) for s in runs}
    per = ", ".join(f"{step_ms(b, v) / step_ms(a, v):.3f}" for a, b in zip(runs["old"], runs["new"]))
    print(f"| {v} | {r['old']:.3f}x | {r['new']:.3f}x | {100 * (r['new'] / r['old'] - 1):+.1f} % | {per} |")
PY
