#!/usr/bin/env bash
# Issues 28 and 29's GPU rows on one H200, in the order a 30-minute lease should get them,
# into FOLDER (BENCHMARKS.md's leases). weft, torchao and flash-attn-4 on
# PYTHONPATH (DEVELOPERS.md). It runs longer than one device call: start it with
# benchmarks/detached.sh and watch it from there, each call sent the moment the last returns.
#   bash benchmarks/detached.sh start /tmp/res bash benchmarks/lease_rows.sh /tmp/res
set -u
dest=${1:?folder}; here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$dest/gen" "$dest/f8"
stage() { echo "$(date +%T) $1" >> "$dest/progress"; }
# 2026-12-04's order (session 18's lease: issue 28's lines all met, 7.16 ms a token at 128K;
# float8 tensorwise 4,620 tok/s at 128K; the loss curves' held-out evaluation found no samples
# past the device's corpus, since held out at its start): the held-out loss curves first (c), the
# peak's allocations of the LoRA 128K step and of the same step without adapters (docs/estimate.md:
# the ~30 GiB the CPU does not show), d into c's folder (rowwise, the optimizer's variants), then
# the rows never measured (512K, chunked prefill, the parts of the decoding step), then the rest.
stage "float8 c"; (cd "$(mktemp -d)" && OUT="$dest/f8" bash "$here/float8_rows.sh" c > "$dest/f8-c.txt" 2>&1)
stage "memory peaks"; for recipe in qwen2.5-vl-7b-lora-128k-1gpu qwen2.5-vl-7b-128k-1gpu; do  # the LoRA surplus
  (cd "$(mktemp -d)" && timeout 420 python3 "$here/memory_peak.py" --out "$dest/peak-$recipe" "$recipe" --step 2 \
    > "$dest/peak-$recipe.txt" 2>&1; rm -rf "$dest/peak-$recipe/run/checkpoints"); done
stage "float8 d"; (cd "$(mktemp -d)" && OUT="$dest/f8" bash "$here/float8_rows.sh" d > "$dest/f8-d.txt" 2>&1)
stage "held-out evaluation in a 7B run"; (cd "$(mktemp -d)" && timeout 400 python3 -m weft run qwen2.5-vl-7b-32k-1gpu \
  --run-dir "$dest/eval-32k" --set train.max_steps=4 --set eval.every=2 > "$dest/eval-32k.txt" 2>&1)  # [eval] on the GPU
stage "decoding, longer prompts (28l)"; (cd "$(mktemp -d)" && OUT="$dest/gen" bash "$here/generate_long.sh" 28l > "$dest/gen-28l.txt" 2>&1)
stage "decoding (28x)"; (cd "$(mktemp -d)" && OUT="$dest/gen" bash "$here/generate_long.sh" 28x > "$dest/gen-28x.txt" 2>&1)
stage "float8 b"; (cd "$(mktemp -d)" && OUT="$dest/f8" bash "$here/float8_rows.sh" b > "$dest/f8-b.txt" 2>&1)
stage "decode attention sweep"; (cd "$(mktemp -d)" && timeout 400 python3 "$here/decode_attention.py" --sweep \
  --out "$dest/attn-sweep" > "$dest/attn-sweep.txt" 2>&1)
stage "decoding (28)"; (cd "$(mktemp -d)" && OUT="$dest/gen" bash "$here/generate_long.sh" 28 > "$dest/gen-28.txt" 2>&1)
stage done
