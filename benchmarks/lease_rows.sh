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
# 2026-12-03's order (session 17's lease: the step traced whole, 7.04 ms replayed at 128K, the
# fast tokens equal to eager; float8 tensorwise 1.65x plain transformers at 32K; its 128K row and
# the loss curves did not come back): issue 28's lines again first (the per-token figure without
# the one-time work: the issue's last line), then issue 29's missing rows (128K float8 as bundled,
# the held-out loss curves), then what is left.
stage "decoding (28)"; (cd "$(mktemp -d)" && OUT="$dest/gen" bash "$here/generate_long.sh" 28 > "$dest/gen-28.txt" 2>&1)
stage "float8 e"; (cd "$(mktemp -d)" && OUT="$dest/f8" bash "$here/float8_rows.sh" e > "$dest/f8-e.txt" 2>&1)
stage "float8 c"; (cd "$(mktemp -d)" && OUT="$dest/f8" bash "$here/float8_rows.sh" c > "$dest/f8-c.txt" 2>&1)
stage "decoding numerics (28a)"; (cd "$(mktemp -d)" && OUT="$dest/gen" bash "$here/generate_long.sh" 28a > "$dest/gen-28a.txt" 2>&1)
stage "decoding, longer prompts (28l)"; (cd "$(mktemp -d)" && OUT="$dest/gen" bash "$here/generate_long.sh" 28l > "$dest/gen-28l.txt" 2>&1)
stage "float8 a"; (cd "$(mktemp -d)" && OUT="$dest/f8" bash "$here/float8_rows.sh" a > "$dest/f8-a.txt" 2>&1)
stage "decoding (28x)"; (cd "$(mktemp -d)" && OUT="$dest/gen" bash "$here/generate_long.sh" 28x > "$dest/gen-28x.txt" 2>&1)
stage "float8 b"; (cd "$(mktemp -d)" && OUT="$dest/f8" bash "$here/float8_rows.sh" b > "$dest/f8-b.txt" 2>&1)
stage "decode attention sweep"; (cd "$(mktemp -d)" && timeout 400 python3 "$here/decode_attention.py" --sweep \
  --out "$dest/attn-sweep" > "$dest/attn-sweep.txt" 2>&1)
stage "float8 d"; (cd "$(mktemp -d)" && OUT="$dest/f8" bash "$here/float8_rows.sh" d > "$dest/f8-d.txt" 2>&1)
stage done
