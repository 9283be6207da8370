#!/usr/bin/env bash
# Issue 29's rows on one H200, in calls of under 10 minutes (weft, torchao and flash-attn-4 on
# PYTHONPATH as DEVELOPERS.md says; from the checkout's root):
#   bash benchmarks/float8_rows.sh a   # 7B 32K: float8 as bundled (tensorwise), plain transformers, bf16 as bundled (the 1.5x trio)
#   bash benchmarks/float8_rows.sh b   # 7B 32K float8 rowwise, rowwise_with_gw_hp (the bundled layout)
#   bash benchmarks/float8_rows.sh e   # 7B 128K float8 as bundled (3 steps)
#   bash benchmarks/float8_rows.sh c   # loss curves: 0.5B on the standard library's text, bf16 (two seeds), float8 tensorwise; held-out loss
#   bash benchmarks/float8_rows.sh d   # into c's folder: float8 rowwise, float32 masters, round-to-nearest bf16 (bf16 if c left it)
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
    run f8-32k qwen2.5-vl-7b-32k-float8-1gpu 6 200
    timeout 200 python3 "$here/train.py" --out "$dest/hf" --only 7b:32768 --steps 5 --skip-weft > "$dest/hf.log" 2>&1
    echo "hf rc=$?" | tee -a "$dest/status.txt"; tail -n 3 "$dest/hf.log"
    run bf16-32k qwen2.5-vl-7b-32k-1gpu 6 $((590 - SECONDS)) ;;
  b)
    # The other scalings: the bundled float8 recipe (tensorwise since 2026-12-02) with its recipe
    # key changed (one layout, not two).
    for scaling in rowwise rowwise_with_gw_hp; do
      sed "s/float8_recipe = \"tensorwise\"/float8_recipe = \"$scaling\"/" \
        "$(bundled qwen2.5-vl-7b-32k-float8-1gpu.toml)" > "$work/7b-32k-float8-$scaling.toml"
      grep -q "float8_recipe = \"$scaling\"" "$work/7b-32k-float8-$scaling.toml" \
        || echo "float8_rows.sh: the $scaling variant's rules were not rewritten" >&2
      run "f8$scaling-32k" "$work/7b-32k-float8-$scaling.toml" 6 $(((590 - SECONDS) / 2))
    done ;;
  e)
    run f8-128k qwen2.5-vl-7b-128k-float8-1gpu 3 500 ;;
  c)
    timeout 580 python3 "$here/loss_curves.py" --out "$dest/curves" --steps 300 --compile \
      --only bf16,float8-tensorwise,bf16-seed1 > "$dest/curves.log" 2>&1
    echo "curves rc=$?" | tee -a "$dest/status.txt"; tail -n 8 "$dest/curves.log" ;;
  d)  # into c's folder: its loss_curves.json keeps c's variants, the table compares all against c's bf16
    timeout 580 python3 "$here/loss_curves.py" --out "$dest/curves" --steps 300 --compile \
      --only bf16,float8-rowwise,float32-master,bf16-round-to-nearest > "$dest/curves-d.log" 2>&1
    echo "curves d rc=$?" | tee -a "$dest/status.txt"; tail -n 8 "$dest/curves-d.log" ;;
esac
