#!/usr/bin/env bash
# The three 4-layer profiles of issue 46 (7B 128K, 7B 32K, 72B QLoRA 128K) into FOLDER:
#   bash benchmarks/step/profile_variants.sh FOLDER   (weft, structlog, torchao, flash-attn-4 importable)
dest=${1:?}; here=$(cd "$(dirname "$0")/.." && pwd); mkdir -p "$dest"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$dest/gpu.txt"
for v in 7b-128k-4layers 7b-32k-4layers 72b-qlora-128k-4layers; do
  timeout 420 python3 "$here/step/profile_step.py" --out "$dest/$v" "$here/step/variants/$v.toml" --step 3 > "$dest/$v.log" 2>&1
  echo "$v rc=$?" | tee -a "$dest/status.txt"
done
