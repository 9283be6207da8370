#!/usr/bin/env bash
# Issues 28 and 29's GPU rows on one H200, in the order a 30-minute lease should get them,
# into FOLDER: the Triton decode attention against the plain-torch one, the static cache's
# decoding against plain transformers (generate_long.sh 28), the 7B at 32K in float8 beside
# plain transformers and bf16 (float8_rows.sh a), the loss curves on real text (c), what each
# part of the decoding step buys (generate_long.sh 28x), the attention kernel's config sweep,
# the 128K float8 row and tensorwise (b), the dynamic/paged decoding rows (generate_long.sh
# 15) and the optimizer's curves (d). weft, torchao and flash-attn-4 on
# PYTHONPATH (DEVELOPERS.md). It runs longer than one device call: start it with
# benchmarks/detached.sh and watch it from there, each call sent the moment the last returns.
#   bash benchmarks/detached.sh start /tmp/res bash benchmarks/lease_rows.sh /tmp/res
set -u
dest=${1:?folder}; here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$dest/gen" "$dest/f8"
stage() { echo "$(date +%T) $1" >> "$dest/progress"; }
# The Triton decode attention against the plain-torch one first (a minute: whether the kernel
# is right and fast on this GPU before anything decodes through it); its config sweep later.
stage "decode attention"; (cd "$(mktemp -d)" && timeout 240 python3 "$here/decode_attention.py" --out "$dest/attn" \
  > "$dest/attn.txt" 2>&1)
stage "decoding (28)"; (cd "$(mktemp -d)" && OUT="$dest/gen" bash "$here/generate_long.sh" 28 > "$dest/gen-28.txt" 2>&1)
for part in a c; do
  stage "float8 $part"; (cd "$(mktemp -d)" && OUT="$dest/f8" bash "$here/float8_rows.sh" "$part" > "$dest/f8-$part.txt" 2>&1)
done
stage "decoding (28x)"; (cd "$(mktemp -d)" && OUT="$dest/gen" bash "$here/generate_long.sh" 28x > "$dest/gen-28x.txt" 2>&1)
stage "decode attention sweep"; (cd "$(mktemp -d)" && timeout 400 python3 "$here/decode_attention.py" --sweep \
  --out "$dest/attn-sweep" > "$dest/attn-sweep.txt" 2>&1)
stage "float8 b"; (cd "$(mktemp -d)" && OUT="$dest/f8" bash "$here/float8_rows.sh" b > "$dest/f8-b.txt" 2>&1)
stage "decoding (15)"; (cd "$(mktemp -d)" && OUT="$dest/gen" bash "$here/generate_long.sh" 15 > "$dest/gen-15.txt" 2>&1)
stage "float8 d"; (cd "$(mktemp -d)" && OUT="$dest/f8" bash "$here/float8_rows.sh" d > "$dest/f8-d.txt" 2>&1)
stage done
