#!/usr/bin/env bash
# Issue 29's rows on one H200, in calls of under 10 minutes (weft, torchao and flash-attn-4 on
# PYTHONPATH as DEVELOPERS.md says; from the checkout's root):
#   bash benchmarks/float8_rows.sh a   # 7B 32K: float8 rowwise, plain transformers, bf16 as bundled (the 1.5x trio)
#   bash benchmarks/float8_rows.sh b   # 7B 32K float8 tensorwise, rowwise_with_gw_hp; rowwise, layers 0-13 unrecomputed and whole-compiled
#   bash benchmarks/float8_rows.sh e   # 7B 128K float8 rowwise (3 steps)
#   bash benchmarks/float8_rows.sh c   # loss curves: 0.5B on the standard library's text, bf16 (two seeds), float8
#   bash benchmarks/float8_rows.sh d   # the same for the optimizer: round-to-nearest bf16, float32 masters
set -uo pipefail
dest=${OUT:-/tmp/f8-out}; work=/tmp/f8; mkdir -p "$dest" "$work"
here=$(cd "$(dirname "$0")" && pwd)
run() {  # $1 name, $2 recipe, $3 steps, $4 seconds
  (cd "$work" && timeout "$4" python3 -m weft run "$2" --run-dir "$work/$1" --set "train.max_steps=$3" \
    > "$dest/$1.log" 2>&1); echo "$1 rc=$?" | tee -a "$dest/status.txt"
  cp "$work/$1/metrics.jsonl" "$dest/$1.metrics.jsonl" 2>/dev/null
  grep -E "step.end" "$dest/$1.log" | tail -n 2 | cut -c1-300
}
bundled() { python3 -c "import sys, weft.core.recipe.syntax as s; print(s.bundled_path(sys.argv[1]))" "$1"; }
case "${1:?stage a, b, c, d or e}" in
  a)
    run f8row-32k qwen2.5-vl-7b-32k-float8-1gpu 6 200
    timeout 200 python3 "$here/train.py" --out "$dest/hf" --only 7b:32768 --steps 5 --skip-weft > "$dest/hf.log" 2>&1
    echo "hf rc=$?" | tee -a "$dest/status.txt"; tail -n 3 "$dest/hf.log"
    run bf16-32k qwen2.5-vl-7b-32k-1gpu 6 $((590 - SECONDS)) ;;
  b)
    # tensorwise: the bundled float8 recipe with its recipe key changed (one layout, not two)
    sed 's/float8_recipe = "rowwise"/float8_recipe = "tensorwise"/' "$(bundled qwen2.5-vl-7b-32k-float8-1gpu.toml)" \
      > "$work/7b-32k-float8-tensorwise.toml"
    run f8tensor-32k "$work/7b-32k-float8-tensorwise.toml" 6 200
    sed 's/float8_recipe = "rowwise"/float8_recipe = "rowwise_with_gw_hp"/' "$(bundled qwen2.5-vl-7b-32k-float8-1gpu.toml)" \
      > "$work/7b-32k-float8-gwhp.toml"
    run f8gwhp-32k "$work/7b-32k-float8-gwhp.toml" 6 200
    # What float8's smaller activations buy (116.9 GiB against bf16's 132.6 at 32K, 2026-12-01):
    # layers 10-13 unrecomputed too (~3.5 GiB each), the MLP's recomputation spared there, and
    # every unrecomputed layer compiled as one graph (compile_scope = "unit": float8's casts
    # fused across the layer's children).
    awk '{print} /^when = \{ path = "\*\.language_model\.layers\.\[0-9\]" \}/ {keep=1} keep && /^shard/ {
           print "\n[[rules]]\nname = \"decoder layers 10-13: no recomputation\"\nwhen = { path = \"*.language_model.layers.1[0-3]\" }";
           print; keep=0}' "$(bundled qwen2.5-vl-7b-32k-float8-1gpu.toml)" \
      | sed 's/checkpoint = "off", compile = true, matmul = "float8"/checkpoint = "off", compile = true, compile_scope = "unit", matmul = "float8"/' \
      > "$work/7b-32k-float8-tuned.toml"
    [ "$(grep -c 'compile_scope = "unit"' "$work/7b-32k-float8-tuned.toml")" = 2 ] \
      || echo "float8_rows.sh: the tuned variant's rules were not rewritten" >&2
    run f8row-32k-tuned "$work/7b-32k-float8-tuned.toml" 6 $((590 - SECONDS)) ;;
  e)
    run f8row-128k qwen2.5-vl-7b-128k-float8-1gpu 3 500 ;;
  c)
    timeout 580 python3 "$here/loss_curves.py" --out "$dest/curves" --steps 300 --compile \
      --only bf16,float8-rowwise,bf16-seed1,float8-tensorwise > "$dest/curves.log" 2>&1  # the last if time allows
    echo "curves rc=$?" | tee -a "$dest/status.txt"; tail -n 8 "$dest/curves.log" ;;
  d)
    timeout 580 python3 "$here/loss_curves.py" --out "$dest/curves-optimizer" --steps 300 \
      --only bf16-round-to-nearest,float32-master,bf16 > "$dest/curves-optimizer.log" 2>&1
    echo "curves-optimizer rc=$?" | tee -a "$dest/status.txt"; tail -n 8 "$dest/curves-optimizer.log" ;;
esac
