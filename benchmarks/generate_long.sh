#!/usr/bin/env bash
# Issue 15's GPU rows: Qwen2.5-VL-7B (random init) prefilling a 128K-token prompt (one
# 448x448 image, the rest synthetic text: the bundled 128K recipe's own first sample) and
# decoding 100 tokens, on one H200 (dynamic cache) and over two (ring 2, sharded cache); then
# the same with the paged cache (benchmarks/variants/7b-128k-paged-cache.toml), and on one with
# the static cache (benchmarks/variants/7b-128k-static-cache.toml).
# Run from a scratch folder with weft installed (the checkout's weft/ would shadow it):
#   cd "$(mktemp -d)" && bash <checkout>/benchmarks/generate_long.sh      # OUT=... for the JSON
set -uo pipefail
out="${OUT:-generate-long}"
mkdir -p "$out"
common=(qwen2.5-vl-7b-128k-1gpu --prompt-from-data --max-new-tokens 100 --warmup --json)
python3 -m weft generate "${common[@]}" --nproc 1 > "$out/one.json" 2> "$out/one.err"
python3 -m weft generate "${common[@]}" --nproc 2 --set parallel.ring=2 > "$out/two.json" 2> "$out/two.err"
here=$(cd "$(dirname "$0")" && pwd)
paged=("$here/variants/7b-128k-paged-cache.toml" "${common[@]:1}")
python3 -m weft generate "${paged[@]}" --nproc 1 > "$out/one-paged.json" 2> "$out/one-paged.err"
python3 -m weft generate "${paged[@]}" --nproc 2 --set parallel.ring=2 > "$out/two-paged.json" 2> "$out/two-paged.err"
static=("$here/variants/7b-128k-static-cache.toml" "${common[@]:1}")
python3 -m weft generate "${static[@]}" --nproc 1 > "$out/one-static.json" 2> "$out/one-static.err"
# Issue 28's batch row: 8 prompts of 16K tokens decoded together, against one of them alone.
short=(--set data.tokens=16384 --set train.micro_batch_tokens=16384 --max-new-tokens 100 --json --nproc 1)
python3 -m weft generate qwen2.5-vl-7b-128k-1gpu --prompt-from-data 1 "${short[@]}" > "$out/16k-one.json" 2> "$out/16k-one.err"
python3 -m weft generate qwen2.5-vl-7b-128k-1gpu --prompt-from-data 8 "${short[@]}" > "$out/16k-eight.json" 2> "$out/16k-eight.err"
python3 - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = {}
for name in ("one", "two", "one-paged", "two-paged", "one-static"):
    try:
        rows[name] = json.loads((out / f"{name}.json").read_text())
    except ValueError:
        print(f"{name}: FAILED (see {name}.err)")
print("| GPUs | cache | prompt | prefill s | prefill tok/s | decode ms/token | cache GiB per GPU | peak GiB |")
print("|---:|---|---:|---:|---:|---:|---:|---:|")
for name, r in rows.items():
    cache = ", ".join(f"{b / 2**30:.2f}" for b in r["cache_bytes_per_rank"])
    print(f"| {r['world_size']} | {r['cache']} | {r['prompt_tokens']:,} | {r['prefill_s']:.2f} | "
          f"{r['prefill_tokens_per_s']:,.0f} | {r['decode_ms_per_token']:.1f} | {cache} | {r['max_memory_gib']:.1f} |")
if "one" in rows and "two" in rows:
    print(f"prefill speed-up on two: {rows['one']['prefill_s'] / rows['two']['prefill_s']:.2f}x; "
          f"same tokens: {rows['one']['tokens'] == rows['two']['tokens']}")
try:
    one, eight = (json.loads((out / f"16k-{n}.json").read_text()) for n in ("one", "eight"))
    single = 1e3 / one["decode_ms_per_token"]
    print(f"16K x 8 together: {eight['decode_tokens_per_s']:,.0f} tokens/s against one prompt's {single:,.0f} "
          f"({eight['decode_tokens_per_s'] / single:.2f}x); first answer as alone: "
          f"{eight['answers'][0]['tokens'] == one['tokens']}")
except (OSError, ValueError, KeyError) as error:
    print(f"16K batch: FAILED ({error}; see 16k-*.err)")
for name in ("one-paged", "two-paged", "one-static"):
    if name in rows and "one" in rows:
        print(f"{name}: same tokens as the dynamic cache: {rows[name]['tokens'] == rows['one']['tokens']}")
PY
