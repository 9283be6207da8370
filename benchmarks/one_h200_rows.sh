#!/usr/bin/env bash
# One H200's rows for issues 14-17, in one command (~8 minutes), each stage packed into
# $OUT/rows.tgz as it ends (a stage cut by the command's limit leaves the earlier ones):
#   1. qwen2.5-vl-7b-32k-1gpu, 10 steps: the run `weft report` draws for the README (#17),
#      and the state memory (summary.json state_gib) with every parameter trained;
#   2. the same with the vision blocks frozen by rule, 3 steps (#16: state memory saved);
#   3. frontier.py at 128K, 2 steps: peak GPU and host memory beside the planner (#14);
#   4. weft generate: 128K-token prompt, 100 tokens, one GPU (#15).
# Run with weft installed and from outside the checkout (DEVELOPERS.md):
#   bash <checkout>/benchmarks/one_h200_rows.sh
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-/tmp/rows-out}
work=/tmp/rows
mkdir -p "$out" "$work"
cd "$work" || exit 1
pack() { tar czf "$out/rows.tgz" -C "$work" . ; echo "packed after $1 at ${SECONDS}s"; }
timeout 170 python3 -m weft run qwen2.5-vl-7b-32k-1gpu --run-dir "$work/r32k" > "$work/r32k.log" 2>&1
pack 32k
timeout 110 python3 -m weft run "$repo/benchmarks/variants/7b-32k-frozen-vision.toml" --run-dir "$work/r32k-frozen" \
  --set train.max_steps=3 > "$work/r32k-frozen.log" 2>&1
pack frozen
timeout 210 python3 "$repo/benchmarks/frontier.py" --out "$work/fr128" --recipe qwen2.5-vl-7b-512k-1gpu \
  --lengths 131072 --steps 2 --timeout 195 > "$work/fr128.log" 2>&1
pack frontier
timeout $((590 - SECONDS)) python3 -m weft generate qwen2.5-vl-7b-128k-1gpu --prompt-from-data --max-new-tokens 100 \
  --warmup --json --nproc 1 > "$work/gen-one.json" 2> "$work/gen-one.err"
pack generate
