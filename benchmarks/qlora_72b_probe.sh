#!/usr/bin/env bash
# The 72B QLoRA recipe on one H200, sampled: nvidia-smi's memory in use and the host's used
# memory every second beside the run's own metrics. Usage (weft, torchao and flash-attn-4 on
# PYTHONPATH, DEVELOPERS.md):
#   bash benchmarks/qlora_72b_probe.sh STEPS SECONDS [--resume] [--set k=v ...]
set -uo pipefail
steps=${1:?steps}; limit=${2:?seconds}; shift 2
dest=${OUT:-/tmp/q72-out}; work=/tmp/q72; mkdir -p "$dest" "$work"
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 1000 > "$dest/gpu.smi" & gpu=$!
(while sleep 1; do free -m | awk '/Mem:/ {print $3}'; done) > "$dest/host.mem" & host=$!
(cd "$work" && timeout "$limit" python3 -m weft run qwen2.5-vl-72b-qlora-128k-1gpu --run-dir "$work/run" \
  --set "train.max_steps=$steps" "$@" > "$dest/run.log" 2>&1); echo "run rc=$?" | tee "$dest/status.txt"
kill "$gpu" "$host"
cp "$work/run/metrics.jsonl" "$work/run/summary.json" "$dest/" 2>/dev/null
echo "gpu max MiB $(sort -n "$dest/gpu.smi" | tail -1), host max MiB $(sort -n "$dest/host.mem" | tail -1)"
grep -E "weights\.|step.end|run.end|rror|Killed" "$dest/run.log" | cut -c1-400 | tail -n 12
