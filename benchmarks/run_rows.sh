#!/usr/bin/env bash
# The GPU rows that need more than one script, in the order a lease should get them: one named
# set per sequence, each a few device calls of under 10 minutes (or, for `lease`, one process
# watched by calls: DEVELOPERS.md, "Work longer than one device call"). The scripts each set runs
# live in the rooms beside this file (benchmarks/README.md); BENCHMARKS.md records every figure
# with the command that made it.
#
#   bash benchmarks/run_rows.sh SET [ARGS...]
#   bash benchmarks/run_rows.sh help              # this list
#
# weft importable (DEVELOPERS.md: installed into a folder on PYTHONPATH; torchao and flash-attn-4
# beside it where a recipe uses them) unless the set says otherwise.
#
# finetune STAGE   one H200, from the checkout's root; runs under /tmp/i25, files to $OUT
#                  (/tmp/i25-out), <stage>.tgz after each part; nvidia-smi samples the device's
#                  memory in use (reserved memory and the CUDA context included) beside each run.
#                  BENCHMARKS.md, "A real fine-tune: the rounding-safe optimizer, ...":
#   a  learning/finetune_flow.py (the 3B Hugging Face directory flow); step/optimizer_step.py (8.3B)
#   b  weft run qwen2.5-vl-7b-128k-1gpu as shipped, 10 steps; a 32K run
#   c  two more 32K runs; step/train.py --skip-weft (plain transformers at 32K), same lease
#   d  step/optimizer_step.py --optimizers adamw_8bit,adamw_sr (torchao's 8-bit states; carry torchao)
#   e  three 32K runs of 6 steps, one after another
#   f  plain transformers at 32K (after e, same lease)
#
# one-gpu          one H200 (~8 minutes), weft installed, from anywhere; runs under /tmp/rows,
#                  each stage packed into $OUT/rows.tgz (/tmp/rows-out) as it ends.
#                  BENCHMARKS.md, "512K tokens on one H200, after the fix" and "A frozen vision tower":
#   1. qwen2.5-vl-7b-32k-1gpu, 10 steps: the run `weft report` draws for the README, and the state
#      memory (summary.json state_gib) with every parameter trained;
#   2. memory/variants/7b-32k-frozen-vision.toml (the vision blocks frozen by rule), 3 steps;
#   3. frontier/frontier.py at 128K, 2 steps: peak GPU and host memory beside the planner;
#   4. weft generate: 128K-token prompt, 100 tokens, one GPU.
#
# float8 STAGE     one H200, from the checkout's root (weft, torchao and flash-attn-4 on PYTHONPATH);
#                  runs under /tmp/f8, files to $OUT (/tmp/f8-out). BENCHMARKS.md's float8 rows
#                  ("float8 at 32K", "float8 ... at 128K", "Loss curves on real text"):
#   a  7B 32K: float8 as bundled (tensorwise), plain transformers (step/train.py), bf16 as bundled
#   b  7B 32K float8 rowwise, rowwise_with_gw_hp (the bundled recipe with its scaling key changed)
#   e  7B 128K float8 as bundled (3 steps)
#   c  learning/loss_curves.py: 0.5B on the standard library's text, bf16 (two seeds), float8
#      tensorwise; held-out loss
#   d  into c's folder: float8 rowwise, float32 masters, round-to-nearest bf16 (bf16 if c left it)
#
# learning OUT     one call on one H200, from the checkout's root: models trained by weft from random
#                  weights on real data, then scored on held-out questions. BENCHMARKS.md, "It learns
#                  on the GPU":
#   1. examples/text_choice on the device's own standard library: more steps than the CPU can give;
#      multiple choice by log-likelihood.
#   2. examples/digits/digits_grid.toml: rows of 3-8 digits at 56 px a digit, a 33.7M-parameter
#      Qwen2.5-VL; exact match of the whole digit string by greedy generation.
#   Carry .whl (structlog) and examples/digits/data_grid (make_grids.py's output: scikit-learn is
#   not on the device). Each row's files go to OUT/rows.tgz as the row ends. TEXT_STEPS, GRID_STEPS,
#   GRID_TOKENS (tokens a step), GRID_LRS and the *_LIMIT seconds override the defaults; PY the
#   interpreter (unset: weft and structlog installed into a fresh folder); ROWS="grid" (or "text")
#   runs one row only, keeping the other's runs (a second call on a warm machine).
#
# lease FOLDER     the decoding and float8 rows in the order a 30-minute lease should get them, into
#                  FOLDER: longer than one device call, so started detached and watched:
#                    bash benchmarks/detached.sh start /tmp/res bash benchmarks/run_rows.sh lease /tmp/res
#                  float8 c, memory/memory_peak.py (the LoRA 128K step and the same without adapters),
#                  float8 d, a 7B run's held-out evaluation, decode/generate_long.sh 28l and 28x,
#                  float8 b, attention/decode_attention.py --sweep, decode/generate_long.sh 28.
#                  BENCHMARKS.md's leases of decoding and float8 rows; benchmarks/lease_status.py reads
#                  FOLDER.
#
# qlora-72b STEPS SECONDS [--resume] [--set k=v ...]
#                  the 72B QLoRA recipe on one H200, sampled: nvidia-smi's memory in use and the host's
#                  used memory every second beside the run's own metrics; runs under /tmp/q72, files to
#                  $OUT (/tmp/q72-out). BENCHMARKS.md, "Qwen2.5-VL-72B with a 4-bit base".
#
# planned STAGE    one H200, from the checkout's root (weft, structlog, torchao on PYTHONPATH); runs
#                  under /tmp/pl, files to $OUT (/tmp/pl-out): the rows planned but not yet measured.
#   a  qwen2.5-vl-7b-dpo-lora-32k-1gpu, 6 steps, nvidia-smi beside it, `weft plan --estimate --json`
#      (BENCHMARKS.md, "Preference training on the GPU: Qwen2.5-VL-7B, LoRA DPO on 32K-token pairs")
#   b  frontier/frontier.py on frontier/slice-1m-4layers-1gpu.toml at 1,048,576 tokens, 2 steps
#      (SLICE_LIMIT seconds, default 580: more where started detached)
#      (BENCHMARKS.md, "One million tokens on one H200, planned")
#
# retrieval [WARM [DATA]]
#                  one H200, from anywhere (weft installed; the checkout's examples/digits/data made
#                  by examples/digits/make_digits.py, carried): examples/long/retrieval_128k.py at its
#                  defaults under /tmp/ret for at most $LIMIT s (550), files to $OUT (/tmp/ret-out/ret.tgz).
#                  Call it again on the same machine until ret.tgz holds table.md: each call goes on where
#                  the last stopped (done phases skipped, runs resumed from their checkpoints). WARM: an
#                  exported warm-stage model (trained elsewhere, carried) put in as /tmp/ret/warm-hf;
#                  DATA: the script's data folder or a .tgz of it, made elsewhere by `--data-only`
#                  (the same seeds give the same lines), put in as /tmp/ret/data.
#                  BENCHMARKS.md, "Retrieval to 128K on one H200" (issue 44).
# retrieval-again NAME [SCRIPT ARGS]
#                  after `retrieval` has trained and evaluated its base model on this machine: a
#                  second fine-tune (e.g. NAME=lr15 --finetune-lr 1.5e-4) from the same base model,
#                  data and evaluations before it (linked), under /tmp/ret-NAME, YaRN only, files to
#                  $OUT/ret-NAME.tgz; called again, it goes on like `retrieval`.
# limits FOLDER     issue 46's rows for whichever card the lease brings, into FOLDER (started detached:
#                  benchmarks/detached.sh). weft, structlog, torchao and flash-attn-4 on PYTHONPATH.
#                  PARTS (default: all but slice) says which, in this order: decode, on
#                  an H200 (over 100 GB) decode/generate_long.sh 28u (fused projections or not, the
#                  copy bandwidth); nf4 memory/nf4_expand.py; prof72b step/profile_step.py on
#                  step/variants/72b-qlora-128k-4layers.toml (the 72B's 4-bit layers, per layer);
#                  peak, peak32k, peaklora memory/memory_peak.py on the 4-layer variants 7b-128k-,
#                  7b-32k-, 7b-lora-128k-4layers (what holds each peak); slice (only where named, on
#                  an H200) `planned b`: the 1M slice, 2 steps, SLICE_LIMIT 900; slice2 (the same, on an
#                  H200) its 2-layer twin frontier/slice-1m-2layers-1gpu.toml, 2 steps, ~7 minutes; byhand
#                  step/mlp_by_hand.py (a recomputed MLP by hand against torch's checkpoint of the
#                  compiled one); ab128s, ablora, ab72s, and on an H200 ab32 and ab128: weft run, 5
#                  steps, of the 4-layer variants 7b-128k-, 7b-lora-128k-, 72b-qlora-128k-4layers, the
#                  bundled 32K and 128K recipes, this tree's weft, then, where
#                  OLD_SITE is set, the one installed there (another commit: the same lease's before and after).
#                  The 7B's 4-layer profiles: step/profile_variants.sh. BENCHMARKS.md, issue 46.
#
# Not sets (one script each, run as BENCHMARKS.md records): check/gpu_check.sh (`weft check` on the
# GPUs of one host for every mesh) and decode/generate_long.sh ROWS (`weft generate` at 128K and
# beyond, plain transformers beside).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)

set_finetune() {
  dest=${OUT:-/tmp/i25-out}
  work=/tmp/i25
  out=$work/o  # packed into $dest/<stage>.tgz after each part (a part cut by the limit keeps the earlier ones)
  mkdir -p "$dest" "$work" "$out"
  pack() { tar czf "$dest/$stage.tgz" -C "$out" . ; echo "packed after $1 at ${SECONDS}s"; }
  stage=${1:?stage a, b, c, d, e or f}
  smi() { nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader,nounits -lms 500 > "$out/$1.smi" & }
  run32() {  # $1: name, $2: steps
    smi "$1"; local pid=$!
    (cd "$work" && timeout "$3" python3 -m weft run qwen2.5-vl-7b-32k-1gpu --run-dir "$work/$1" \
      --set "train.max_steps=$2" > "$out/$1.log" 2>&1); echo "$1 rc=$?" | tee -a "$out/status.txt"
    kill "$pid"; cp "$work/$1/metrics.jsonl" "$out/$1.metrics.jsonl" 2>/dev/null
    tail -n 2 "$out/$1.metrics.jsonl" 2>/dev/null; tail -c 600 "$out/$1.log"; pack "$1"
  }
  case "$stage" in
    a)
      timeout 400 python3 "$here/learning/finetune_flow.py" --out "$out" --work "$work/flow" > "$out/flow.log" 2>&1
      echo "flow rc=$?" | tee -a "$out/status.txt"; rm -rf "$work/flow"; tail -c 2500 "$out/flow.log"; pack flow
      timeout 150 python3 "$here/step/optimizer_step.py" --out "$out" > "$out/optimizer.log" 2>&1
      echo "optimizer rc=$?" | tee -a "$out/status.txt"; tail -n 8 "$out/optimizer.log"; pack optimizer ;;
    b)
      smi r128k; pid=$!
      (cd "$work" && timeout 450 python3 -m weft run qwen2.5-vl-7b-128k-1gpu --run-dir "$work/r128k" \
        > "$out/r128k.log" 2>&1); echo "r128k rc=$?" | tee -a "$out/status.txt"
      kill "$pid"; cp "$work/r128k/metrics.jsonl" "$out/r128k.metrics.jsonl" 2>/dev/null
      tail -n 2 "$out/r128k.metrics.jsonl"; tail -c 600 "$out/r128k.log"; pack r128k
      run32 r32k-1 10 $((585 - SECONDS)) ;;
    c)
      run32 r32k-2 6 150
      run32 r32k-3 6 150
      timeout $((580 - SECONDS)) python3 "$here/step/train.py" --out "$out/hf" --only 7b:32768 --steps 5 --skip-weft \
        > "$out/hf.log" 2>&1; echo "hf rc=$?" | tee -a "$out/status.txt"
      tail -n 12 "$out/hf.log"; pack hf ;;
    d)
      timeout 400 python3 "$here/step/optimizer_step.py" --out "$out" --optimizers adamw_8bit,adamw_sr \
        > "$out/optimizer8.log" 2>&1; echo "optimizer8 rc=$?" | tee -a "$out/status.txt"
      grep -v Warning "$out/optimizer8.log" | tail -n 8; pack optimizer8 ;;
    e)
      run32 r32k-1 6 175
      run32 r32k-2 6 175
      run32 r32k-3 6 $((590 - SECONDS)) ;;
    f)
      timeout 400 python3 "$here/step/train.py" --out "$out/hf" --only 7b:32768 --steps 5 --skip-weft \
        > "$out/hf.log" 2>&1; echo "hf rc=$?" | tee -a "$out/status.txt"
      tail -n 12 "$out/hf.log"; pack hf ;;
    *) echo "run_rows.sh finetune: stage a, b, c, d, e or f, not $stage" >&2; return 2 ;;
  esac
}

set_one_gpu() {
  out=${OUT:-/tmp/rows-out}
  work=/tmp/rows
  mkdir -p "$out" "$work"
  cd "$work" || return 1
  pack() { tar czf "$out/rows.tgz" -C "$work" . ; echo "packed after $1 at ${SECONDS}s"; }
  timeout 170 python3 -m weft run qwen2.5-vl-7b-32k-1gpu --run-dir "$work/r32k" > "$work/r32k.log" 2>&1
  pack 32k
  timeout 110 python3 -m weft run "$here/memory/variants/7b-32k-frozen-vision.toml" --run-dir "$work/r32k-frozen" \
    --set train.max_steps=3 > "$work/r32k-frozen.log" 2>&1
  pack frozen
  timeout 210 python3 "$here/frontier/frontier.py" --out "$work/fr128" --recipe qwen2.5-vl-7b-512k-1gpu \
    --lengths 131072 --steps 2 --timeout 195 > "$work/fr128.log" 2>&1
  pack frontier
  timeout $((590 - SECONDS)) python3 -m weft generate qwen2.5-vl-7b-128k-1gpu --prompt-from-data --max-new-tokens 100 \
    --warmup --json --nproc 1 > "$work/gen-one.json" 2> "$work/gen-one.err"
  pack generate
}

set_float8() {
  dest=${OUT:-/tmp/f8-out}; work=/tmp/f8; mkdir -p "$dest" "$work"
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
      timeout 200 python3 "$here/step/train.py" --out "$dest/hf" --only 7b:32768 --steps 5 --skip-weft \
        > "$dest/hf.log" 2>&1
      echo "hf rc=$?" | tee -a "$dest/status.txt"; tail -n 3 "$dest/hf.log"
      run bf16-32k qwen2.5-vl-7b-32k-1gpu 6 $((590 - SECONDS)) ;;
    b)
      # The other scalings: the bundled float8 recipe (tensorwise) with its recipe key changed
      # (one layout, not two).
      for scaling in rowwise rowwise_with_gw_hp; do
        sed "s/float8_recipe = \"tensorwise\"/float8_recipe = \"$scaling\"/" \
          "$(bundled qwen2.5-vl-7b-32k-float8-1gpu.toml)" > "$work/7b-32k-float8-$scaling.toml"
        grep -q "float8_recipe = \"$scaling\"" "$work/7b-32k-float8-$scaling.toml" \
          || echo "run_rows.sh float8: the $scaling variant's rules were not rewritten" >&2
        run "f8$scaling-32k" "$work/7b-32k-float8-$scaling.toml" 6 $(((590 - SECONDS) / 2))
      done ;;
    e)
      run f8-128k qwen2.5-vl-7b-128k-float8-1gpu 3 500 ;;
    c)
      timeout 580 python3 "$here/learning/loss_curves.py" --out "$dest/curves" --steps 300 --compile \
        --only bf16,float8-tensorwise,bf16-seed1 > "$dest/curves.log" 2>&1
      echo "curves rc=$?" | tee -a "$dest/status.txt"; tail -n 8 "$dest/curves.log" ;;
    d)  # into c's folder: its loss_curves.json keeps c's variants, the table compares all against c's bf16
      timeout 580 python3 "$here/learning/loss_curves.py" --out "$dest/curves" --steps 300 --compile \
        --only bf16,float8-rowwise,float32-master,bf16-round-to-nearest > "$dest/curves-d.log" 2>&1
      echo "curves d rc=$?" | tee -a "$dest/status.txt"; tail -n 8 "$dest/curves-d.log" ;;
    *) echo "run_rows.sh float8: stage a, b, c, d or e, not $1" >&2; return 2 ;;
  esac
}

set_learning() {
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
  cd /tmp || return 1

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
}

set_lease() {
  dest=${1:?folder}
  mkdir -p "$dest/gen" "$dest/f8"
  stage() { echo "$(date +%T) $1" >> "$dest/progress"; }
  # The order: the held-out loss curves first (float8 c), the peak's allocations of the LoRA 128K
  # step and of the same step without adapters (docs/estimate.md: the ~30 GiB the CPU does not
  # show), float8 d into c's folder (rowwise, the optimizer's variants), then the rows never
  # measured (512K, chunked prefill, the parts of the decoding step), then the rest.
  stage "float8 c"; (cd "$(mktemp -d)" && OUT="$dest/f8" bash "$here/run_rows.sh" float8 c > "$dest/f8-c.txt" 2>&1)
  stage "memory peaks"; for recipe in qwen2.5-vl-7b-lora-128k-1gpu qwen2.5-vl-7b-128k-1gpu; do  # the LoRA surplus
    (cd "$(mktemp -d)" && timeout 420 python3 "$here/memory/memory_peak.py" --out "$dest/peak-$recipe" "$recipe" \
      --step 2 > "$dest/peak-$recipe.txt" 2>&1; rm -rf "$dest/peak-$recipe/run/checkpoints"); done
  stage "float8 d"; (cd "$(mktemp -d)" && OUT="$dest/f8" bash "$here/run_rows.sh" float8 d > "$dest/f8-d.txt" 2>&1)
  stage "held-out evaluation in a 7B run"; (cd "$(mktemp -d)" && timeout 400 python3 -m weft run \
    qwen2.5-vl-7b-32k-1gpu --run-dir "$dest/eval-32k" --set train.max_steps=4 --set eval.every=2 \
    > "$dest/eval-32k.txt" 2>&1)  # [eval] on the GPU
  stage "decoding, longer prompts (28l)"; (cd "$(mktemp -d)" && OUT="$dest/gen" bash "$here/decode/generate_long.sh" \
    28l > "$dest/gen-28l.txt" 2>&1)
  stage "decoding (28x)"; (cd "$(mktemp -d)" && OUT="$dest/gen" bash "$here/decode/generate_long.sh" 28x \
    > "$dest/gen-28x.txt" 2>&1)
  stage "float8 b"; (cd "$(mktemp -d)" && OUT="$dest/f8" bash "$here/run_rows.sh" float8 b > "$dest/f8-b.txt" 2>&1)
  stage "decode attention sweep"; (cd "$(mktemp -d)" && timeout 400 python3 "$here/attention/decode_attention.py" \
    --sweep --out "$dest/attn-sweep" > "$dest/attn-sweep.txt" 2>&1)
  stage "decoding (28)"; (cd "$(mktemp -d)" && OUT="$dest/gen" bash "$here/decode/generate_long.sh" 28 \
    > "$dest/gen-28.txt" 2>&1)
  stage done
}

set_qlora_72b() {
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
}

set_planned() {
  dest=${OUT:-/tmp/pl-out}
  work=/tmp/pl
  mkdir -p "$dest" "$work"
  stage=${1:?stage a or b}
  case "$stage" in
    a)
      python3 -m weft plan qwen2.5-vl-7b-dpo-lora-32k-1gpu --estimate --json > "$dest/dpo.plan.json" 2>/dev/null
      nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$dest/dpo.smi" & gpu=$!
      (cd "$work" && timeout 540 python3 -m weft run qwen2.5-vl-7b-dpo-lora-32k-1gpu --run-dir "$work/dpo" \
        > "$dest/dpo.log" 2>&1); echo "dpo rc=$?" | tee -a "$dest/status.txt"
      kill "$gpu"; cp "$work/dpo/metrics.jsonl" "$work/dpo/summary.json" "$dest/" 2>/dev/null
      echo "gpu max MiB $(sort -n "$dest/dpo.smi" | tail -1)"
      grep -E "step.end|run.end|rror" "$dest/dpo.log" | cut -c1-400 | tail -n 8 ;;
    b)
      limit=${SLICE_LIMIT:-580}  # detached (benchmarks/detached.sh), two steps may take longer than one call
      timeout "$limit" python3 "$here/frontier/frontier.py" --out "$dest/slice1m" \
        --recipe "$here/frontier/slice-1m-4layers-1gpu.toml" --lengths 1048576 --steps 2 --timeout $((limit - 10)) \
        > "$dest/slice1m.log" 2>&1; echo "slice1m rc=$?" | tee -a "$dest/status.txt"
      tail -n 20 "$dest/slice1m.log" ;;
    *) echo "run_rows.sh planned: stage a or b, not $stage" >&2; return 2 ;;
  esac
}

set_limits() {
  dest=${1:?folder}
  mkdir -p "$dest/u"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$dest/gpu.txt"
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  part() { [[ " ${PARTS:-decode nf4 prof72b peak peak32k peaklora} " == *" $1 "* ]]; }  # PARTS: which, in this order
  h200() { [ "${mib:-0}" -gt 100000 ]; }
  if part decode && h200; then  # the 6.0 ms row is an H200's (an H100's came earlier)
    (cd "$dest/u" && OUT="$dest/u" bash "$here/decode/generate_long.sh" 28u > "$dest/u-28u.log" 2>&1)
    echo "28u rc=$?" | tee -a "$dest/status.txt"
  fi
  if part nf4; then
    timeout 120 python3 "$here/memory/nf4_expand.py" --out "$dest/nf4" > "$dest/nf4.log" 2>&1
    echo "nf4_expand rc=$?" | tee -a "$dest/status.txt"
  fi
  if part prof72b; then
    timeout 420 python3 "$here/step/profile_step.py" --out "$dest/prof72b" \
      "$here/step/variants/72b-qlora-128k-4layers.toml" --step 3 > "$dest/prof72b.log" 2>&1
    echo "profile 72b rc=$?" | tee -a "$dest/status.txt"
  fi
  peak() {  # $1: the part's name, $2: a 4-layer variant: what holds its step's peak
    if part "$1"; then
      timeout 300 python3 "$here/memory/memory_peak.py" --out "$dest/$1" "$here/step/variants/$2.toml" --step 2 \
        > "$dest/$1.log" 2>&1
      echo "memory_peak $2 rc=$?" | tee -a "$dest/status.txt"
    fi
  }
  peak peak 7b-128k-4layers        # 49.1 GiB against the planner's 40 before it was corrected
  peak peak32k 7b-32k-4layers      # the logits loss's peak (its rows keep every gradient, fitted)
  peak peaklora 7b-lora-128k-4layers  # ADAPTER_RECOMPUTE_MLP, fitted to the whole LoRA recipe
  if part byhand; then  # a recomputed MLP by hand against torch's checkpoint of the compiled one
    timeout 300 python3 "$here/step/mlp_by_hand.py" --out "$dest/byhand" > "$dest/byhand.log" 2>&1
    echo "mlp_by_hand rc=$?" | tee -a "$dest/status.txt"
  fi
  ab() {  # $1: the part's name, $2: a recipe or variant, $3: "h200" where it needs one. weft run, 5
    # steps, with this tree's weft, then (OLD_SITE set: another tree installed into a folder) with that one's.
    if part "$1" && { [ "${3:-}" != h200 ] || h200; }; then
      for tree in new ${OLD_SITE:+old}; do
        local path=$PYTHONPATH; [ "$tree" = old ] && path="$OLD_SITE:$PYTHONPATH"
        (cd /tmp && PYTHONPATH=$path timeout 480 python3 -m weft run "$2" --run-dir "$dest/$1-$tree" \
          --set train.max_steps=5 > "$dest/$1-$tree.log" 2>&1)
        echo "$1 $tree rc=$?" | tee -a "$dest/status.txt"
        grep -h '"step"' "$dest/$1-$tree/metrics.jsonl" 2>/dev/null | cut -c1-400 | tail -n 5
      done
    fi
  }
  ab ab128s "$here/step/variants/7b-128k-4layers.toml"   # the 128K recipe's rules over 4 layers
  ab ablora "$here/step/variants/7b-lora-128k-4layers.toml"  # the LoRA 128K recipe's
  ab ab72s "$here/step/variants/72b-qlora-128k-4layers.toml"  # the 72B QLoRA recipe's
  ab ab32 qwen2.5-vl-7b-32k-1gpu h200
  ab ab128 qwen2.5-vl-7b-128k-1gpu h200
  # The 1M slice (~11 minutes for two steps) only where asked (PARTS naming slice), on an H200.
  if part slice && h200; then SLICE_LIMIT=${SLICE_LIMIT:-900} OUT="$dest/pl" set_planned b; fi
  if part slice2 && h200; then  # the same rules over 2 layers: ~2.3 minutes a step planned
    python3 -m weft plan "$here/frontier/slice-1m-2layers-1gpu.toml" --estimate --json > "$dest/slice2.plan.json" 2>/dev/null
    timeout 560 python3 "$here/frontier/frontier.py" --out "$dest/slice2" \
      --recipe "$here/frontier/slice-1m-2layers-1gpu.toml" --lengths 1048576 --steps 2 --timeout 550 \
      > "$dest/slice2.log" 2>&1; echo "slice2 rc=$?" | tee -a "$dest/status.txt"
    tail -n 20 "$dest/slice2.log"
  fi
  return 0
}

ret_pack() {  # $1: the work folder, $2: the archive. What the report needs and the exported models
  # (a few MB), not the data (made again from its seeds) nor the carried warm model; links stay links.
  (cd "$1" && tar czf "$2" --exclude='./data' --exclude='./warm-hf' --exclude='checkpoints' .)
  grep -E "step.end|run.end|rror|Traceback" "$1/ret.log" | cut -c1-300 | tail -n 12
  tail -n 20 "$1/ret.log"
}

ret_script() {  # $1: the work folder, then the script's own arguments. timeout signals its whole
  # process group: the weft runs the script starts end with it.
  local work=$1; shift
  (cd /tmp && timeout "${LIMIT:-550}" python3 "$here/../examples/long/retrieval_128k.py" "$work" \
    --digits "$here/../examples/digits/data" --jobs 14 "$@" >> "$work/ret.log" 2>&1)
  echo "retrieval rc=$? at ${SECONDS}s" | tee -a "$work/status.txt"
}

set_retrieval() {
  dest=${OUT:-/tmp/ret-out}
  work=/tmp/ret
  mkdir -p "$dest" "$work"
  if [ -n "${1:-}" ] && [ ! -d "$work/warm-hf" ]; then cp -r "$1" "$work/warm-hf" || return 1; fi
  if [ -n "${2:-}" ] && [ ! -d "$work/data" ]; then
    if [ -d "$2" ]; then cp -r "$2" "$work/data"; else mkdir "$work/data" && tar xzf "$2" -C "$work/data"; fi || return 1
  fi
  ret_script "$work"
  ret_pack "$work" "$dest/ret.tgz"
}

set_retrieval_again() {
  dest=${OUT:-/tmp/ret-out}
  name=${1:?a name for the second fine-tune}; shift
  work=/tmp/ret-$name
  [ -f /tmp/ret/base-hf/config.json ] || { echo "retrieval-again: /tmp/ret has no base model yet" >&2; return 2; }
  mkdir -p "$dest" "$work/results"
  for p in data warm-hf base base-hf; do [ -e "$work/$p" ] || ln -s "/tmp/ret/$p" "$work/$p"; done
  for r in /tmp/ret/results/base-*; do [ -e "$work/results/$(basename "$r")" ] || ln -s "$r" "$work/results/"; done
  ret_script "$work" --scalings yarn "$@"
  ret_pack "$work" "$dest/ret-$name.tgz"
}

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
what=${1:-help}
[ $# -gt 0 ] && shift
case "$what" in
  finetune) set_finetune "$@" ;;
  one-gpu) set_one_gpu "$@" ;;
  float8) set_float8 "$@" ;;
  learning) set_learning "$@" ;;
  lease) set_lease "$@" ;;
  qlora-72b) set_qlora_72b "$@" ;;
  planned) set_planned "$@" ;;
  limits) set_limits "$@" ;;
  retrieval) set_retrieval "$@" ;;
  retrieval-again) set_retrieval_again "$@" ;;
  help|-h|--help) usage ;;
  *) echo "run_rows.sh: no set $what (finetune, one-gpu, float8, learning, lease, qlora-72b, planned, limits, retrieval, retrieval-again; help lists them)" >&2
     exit 2 ;;
esac
