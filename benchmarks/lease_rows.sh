#!/usr/bin/env bash
# Issues 28 and 29's GPU rows on one H200, in the order a 30-minute lease should get them,
# into FOLDER (the order of 2026-12-01's second lease, after the first measured the Triton
# attention, the 128K decoding and float8 a/c: BENCHMARKS.md). weft, torchao and flash-attn-4 on
# PYTHONPATH (DEVELOPERS.md). It runs longer than one device call: start it with
# benchmarks/detached.sh and watch it from there, each call sent the moment the last returns.
#   bash benchmarks/detached.sh start /tmp/res bash benchmarks/lease_rows.sh /tmp/res
set -u
dest=${1:?folder}; here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$dest/gen" "$dest/f8"
stage() { echo "$(date +%T) $1" >> "$dest/progress"; }
# First what the last lease left open: the compiled step's numerics and graph breaks at 16K
# (generate_long.sh 28a: bf16 and float32, fast and eager), then issue 28's lines again
# (plain transformers, the static cache as shipped, the 16K batch).
stage "decoding numerics (28a)"; (cd "$(mktemp -d)" && OUT="$dest/gen" bash "$here/generate_long.sh" 28a > "$dest/gen-28a.txt" 2>&1)
stage "decoding (28)"; (cd "$(mktemp -d)" && OUT="$dest/gen" bash "$here/generate_long.sh" 28 > "$dest/gen-28.txt" 2>&1)
# Float8 at 32K (tensorwise, rowwise_with_gw_hp, rowwise with fewer layers recomputed and those
# compiled whole), the loss curves with a second bf16 seed, then the 128K float8 row.
for part in b c e; do
  stage "float8 $part"; (cd "$(mktemp -d)" && OUT="$dest/f8" bash "$here/float8_rows.sh" "$part" > "$dest/f8-$part.txt" 2>&1)
done
stage "decoding (28x)"; (cd "$(mktemp -d)" && OUT="$dest/gen" bash "$here/generate_long.sh" 28x > "$dest/gen-28x.txt" 2>&1)
stage "decode attention sweep"; (cd "$(mktemp -d)" && timeout 400 python3 "$here/decode_attention.py" --sweep \
  --out "$dest/attn-sweep" > "$dest/attn-sweep.txt" 2>&1)
stage "float8 a"; (cd "$(mktemp -d)" && OUT="$dest/f8" bash "$here/float8_rows.sh" a > "$dest/f8-a.txt" 2>&1)
stage "decoding (15)"; (cd "$(mktemp -d)" && OUT="$dest/gen" bash "$here/generate_long.sh" 15 > "$dest/gen-15.txt" 2>&1)
stage "float8 d"; (cd "$(mktemp -d)" && OUT="$dest/f8" bash "$here/float8_rows.sh" d > "$dest/f8-d.txt" 2>&1)
stage done
