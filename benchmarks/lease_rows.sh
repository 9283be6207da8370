#!/usr/bin/env bash
# Issues 28 and 29's GPU rows on one H200, in the order a 30-minute lease should get them,
# into FOLDER: the static cache's decoding against plain transformers (generate_long.sh 28),
# the 7B at 32K in bf16 and float8 (float8_rows.sh a), plain transformers at 32K and the 128K
# float8 row (b), the loss curves on real text (c), then flash-attn-4's decode and the dynamic/paged
# decoding rows (generate_long.sh 15). weft, torchao and flash-attn-4 on PYTHONPATH (DEVELOPERS.md). It runs
# longer than one device call: start it with benchmarks/detached.sh and watch it from there.
#   bash benchmarks/detached.sh start /tmp/res bash benchmarks/lease_rows.sh /tmp/res
set -u
dest=${1:?folder}; here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$dest/gen" "$dest/f8"
stage() { echo "$(date +%T) $1" >> "$dest/progress"; }
stage "decoding (28)"; (cd "$(mktemp -d)" && OUT="$dest/gen" bash "$here/generate_long.sh" 28 > "$dest/gen-28.txt" 2>&1)
for part in a b c; do  # d (the optimizer's curves) after the decoding rows
  stage "float8 $part"; (cd "$(mktemp -d)" && OUT="$dest/f8" bash "$here/float8_rows.sh" "$part" > "$dest/f8-$part.txt" 2>&1)
done
stage "decoding (15)"; (cd "$(mktemp -d)" && OUT="$dest/gen" bash "$here/generate_long.sh" 15 > "$dest/gen-15.txt" 2>&1)
stage "float8 d"; (cd "$(mktemp -d)" && OUT="$dest/f8" bash "$here/float8_rows.sh" d > "$dest/f8-d.txt" 2>&1)
stage done
