#!/usr/bin/env bash
# `weft check` on the GPUs of one host, float32, the tiny recipes: the plan on N ranks
# (NCCL) against the unsharded model on the same micro-batches, same initial weights
# (presets drawn on the CPU from the seed), TF32 off on both sides. One JSON per mesh
# under $OUT (or ./gpu-check), and a summary table on stdout.
#   bash benchmarks/check/gpu_check.sh            # on a 2-GPU host, weft installed
# It runs from a scratch folder so that a checkout's own weft/ folder (the package's
# top file only; core/, plugins/... are mapped in by the install) cannot shadow the install.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-gpu-check}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
cd "$(mktemp -d)"
cuda=(--set parallel.device=cuda --set parallel.backend=nccl)
run() {  # name, then weft check arguments
  local name=$1; shift
  python3 -m weft check "$@" "${cuda[@]}" --json > "$out/$name.json" 2> "$out/$name.err"
  python3 - "$out/$name.json" "$name" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except ValueError:
    print(f"{sys.argv[2]:<24} FAILED (see {sys.argv[2]}.err)"); raise SystemExit
print(f"{sys.argv[2]:<24} ok={r['ok']!s:<5} loss_rel={r['loss_rel_diff']:.2e} grad_rel={r['grad_max_rel_diff']:.2e} "
      f"norm_rel={r['grad_norm_rel_diff']:.2e} mesh={r['mesh']}")
PY
}
run dp2 tiny-vl --world-size 2
run ring2 tiny-vl --world-size 2 --set parallel.ring=2
run ulysses2 tiny-vl --world-size 2 --set parallel.ulysses=2
run qwen3_vl_ring2 tiny-vl --world-size 2 --set parallel.ring=2 --set model.preset=qwen3_vl_tiny
run text_ulysses2 tiny-vl --world-size 2 --set parallel.ulysses=2 --set model.preset=qwen2_text_tiny

# bf16 at Qwen2.5-VL-7B's widths (2 layers, 4 vision blocks, one 448x448 image in 8K tokens):
# the plan under bf16 autocast against the float32 reference, within twice the unsharded
# model's own bf16 difference (issue 13). Four-GPU meshes only where four GPUs are present.
w7="$here/check-7b-width.toml"
run w7_dp2 "$w7" --world-size 2
run w7_ring2 "$w7" --world-size 2 --set parallel.ring=2
run w7_ulysses2 "$w7" --world-size 2 --set parallel.ulysses=2
if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 4 ]; then
  run w7_usp2x2 "$w7" --world-size 4 --set parallel.ring=2 --set parallel.ulysses=2
  run w7_dp2_ring2 "$w7" --world-size 4 --set parallel.ring=2
fi
