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
# 2026-12-02's order (session 16's lease found the compiled step's breaks, the recomputation
# hooks, and the cache copy; both fixed on the CPU): issue 28's lines first (plain transformers,
# the static cache as shipped, the 16K batch), the 16K numerics in bf16 (fast against eager),
# then issue 29's: float8 as bundled (tensorwise now) beside plain transformers and bf16 at
# 32K, 128K float8, the loss curves with the held-out evaluation; then what is left.
stage "decoding (28)"; (cd "$(mktemp -d)" && OUT="$dest/gen" bash "$here/generate_long.sh" 28 > "$dest/gen-28.txt" 2>&1)
stage "decoding numerics (28a)"; (cd "$(mktemp -d)" && OUT="$dest/gen" bash "$here/generate_long.sh" 28a > "$dest/gen-28a.txt" 2>&1)
stage "decoding profile (28p)"; (cd "$(mktemp -d)" && OUT="$dest/gen" bash "$here/generate_long.sh" 28p > "$dest/gen-28p.txt" 2>&1)
for part in a e c; do
  stage "float8 $part"; (cd "$(mktemp -d)" && OUT="$dest/f8" bash "$here/float8_rows.sh" "$part" > "$dest/f8-$part.txt" 2>&1)
done
stage "decoding (28x)"; (cd "$(mktemp -d)" && OUT="$dest/gen" bash "$here/generate_long.sh" 28x > "$dest/gen-28x.txt" 2>&1)
stage "float8 b"; (cd "$(mktemp -d)" && OUT="$dest/f8" bash "$here/float8_rows.sh" b > "$dest/f8-b.txt" 2>&1)
stage "decode attention sweep"; (cd "$(mktemp -d)" && timeout 400 python3 "$here/decode_attention.py" --sweep \
  --out "$dest/attn-sweep" > "$dest/attn-sweep.txt" 2>&1)
stage "decoding (15)"; (cd "$(mktemp -d)" && OUT="$dest/gen" bash "$here/generate_long.sh" 15 > "$dest/gen-15.txt" 2>&1)
stage "float8 d"; (cd "$(mktemp -d)" && OUT="$dest/f8" bash "$here/float8_rows.sh" d > "$dest/f8-d.txt" 2>&1)
stage done
