#!/usr/bin/env bash
# Issue 41's GPU rows, one call on one H200: models trained by weft from random weights on real
# data, then scored on held-out questions (BENCHMARKS.md, "It learns on the GPU").
#
#   1. examples/text_choice on the device's own standard library: more steps than the CPU can
#      give (the CPU's 500 steps leave it near chance); multiple choice by log-likelihood.
#   2. examples/digits/digits_grid.toml: rows of 3-8 digits at 56 px a digit (12-32 image
#      tokens), a 33.7M-parameter Qwen2.5-VL; exact match of the whole digit string.
#
# Carry .whl (structlog) and examples/digits/data_grid (make_grids.py's output: scikit-learn is
# not on the device). Run from the checkout's root:
#   bash benchmarks/learning_rows.sh "$OUT"
# Each row's files go to OUT/rows.tgz as the row ends (a device call brings back only so many
# files, and a call cut short keeps the rows done). TEXT_STEPS,
# GRID_STEPS, GRID_TOKENS (tokens a step), GRID_LRS and the *_LIMIT seconds override the defaults; PY the interpreter; ROWS="grid" (or
# "text") runs one row only, keeping the other's runs (a second call on a warm machine).
set -uo pipefail
archive=${1:?output folder}
out=/tmp/learning_out
mkdir -p "$archive" "$out"
root=$PWD
py=${PY:-python3}
if [ -z "${PY:-}" ]; then  # the device: weft and structlog into a folder, run from outside the checkout
  # A fresh folder each call: pip --target skips folders that exist, so a second install into
  # the same one would keep the first call's weft.
  site=/tmp/site-$$
  "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl
  "$py" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$site" .
  export PYTHONPATH=$site
fi
nvidia-smi --query-gpu=name,memory.total --format=csv > "$out/gpu.txt" 2>&1
"$py" -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__)" \
  > "$out/versions.txt" 2>&1
runs=/tmp/learning_runs
rows=${ROWS:-text grid}
mkdir -p "$runs"
cd /tmp

keep() {  # a run's figures (never its checkpoints), then everything so far into OUT/rows.tgz
  mkdir -p "$out/$1"
  cp "$runs/$1/metrics.jsonl" "$runs/$1/summary.json" "$out/$1/" 2>/dev/null
  tar czf "$archive/rows.tgz" -C "$out" .
}

# 1. Text multiple choice: the held-out passages from the device's own standard library.
if [[ $rows == *text* ]]; then
rm -rf "$runs/text"
"$py" "$root/examples/text_choice/make_passages.py" "$runs/text_held_out.jsonl" > "$out/text_make.log" 2>&1
/usr/bin/time -f "%e s" -o "$out/text_run.time" timeout "${TEXT_LIMIT:-200}" \
  "$py" -m weft run "$root/examples/text_choice/text_choice.toml" --run-dir "$runs/text" \
  --set train.max_steps="${TEXT_STEPS:-3000}" --set train.micro_batch_tokens=16384 --set data.num_samples=9000 \
  --set train.checkpoint_every=1000 > "$out/text_run.log" 2>&1
keep text
for step in 1000 2000 3000; do
  [ -d "$runs/text/checkpoints/step-$step" ] || continue
  "$py" -m weft eval "$root/examples/text_choice/text_choice.toml" --run-dir "$runs/text" --step "$step" \
    --task "$runs/text_held_out.jsonl" --results "$out/text.step-$step.results.jsonl" --json \
    > "$out/text_eval.step-$step.json" 2> "$out/text_eval.step-$step.err"
done
keep text
fi

# 2. Rows of digits: train, then the held-out rows by greedy generation (the static cache). One
# run for each learning rate of GRID_LRS, side by side on the one GPU (a 33.7M-parameter model
# leaves most of it idle), named grid-LR.
grid_row() {
  local name=grid-$1
  rm -rf "$runs/$name"
  /usr/bin/time -f "%e s" -o "$out/$name.run.time" timeout "${GRID_LIMIT:-480}" \
    "$py" -m weft run "$root/examples/digits/digits_grid.toml" --run-dir "$runs/$name" \
    --set train.max_steps="${GRID_STEPS:-1000}" --set train.micro_batch_tokens="${GRID_TOKENS:-8192}" \
    --set train.lr="$1" --set train.checkpoint_every=250 > "$out/$name.run.log" 2>&1
  timeout "${EVAL_LIMIT:-90}" "$py" -m weft eval "$root/examples/digits/digits_grid.toml" --run-dir "$runs/$name" \
    --task "$root/examples/digits/data_grid/held_out.jsonl" --max-new-tokens 12 \
    --results "$out/$name.results.jsonl" --json > "$out/$name.eval.json" 2> "$out/$name.eval.err"
}
if [[ $rows == *grid* ]]; then
for lr in ${GRID_LRS:-3e-4}; do grid_row "$lr" & done
wait
for lr in ${GRID_LRS:-3e-4}; do keep "grid-$lr"; done
fi
tail -n 3 "$out"/*eval*.json "$out"/*.time 2>/dev/null
