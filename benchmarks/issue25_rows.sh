#!/usr/bin/env bash
# One H200's rows for issue 25 (a real fine-tune), in three calls of under 10 minutes that
# follow each other while the machine is warm; each stage's files land in $OUT as it ends.
#   bash benchmarks/issue25_rows.sh a   # the 3B Hugging Face directory flow; the 8.3B optimizer step
#   bash benchmarks/issue25_rows.sh b   # qwen2.5-vl-7b-128k-1gpu as shipped, 10 steps; a 32K run
#   bash benchmarks/issue25_rows.sh c   # two more 32K runs; plain transformers at 32K, same lease
#   bash benchmarks/issue25_rows.sh d   # the 8.3B optimizer step with torchao's 8-bit states (carry torchao)
#   bash benchmarks/issue25_rows.sh e   # three 32K runs of 6 steps, one after another
#   bash benchmarks/issue25_rows.sh f   # plain transformers at 32K (after e, same lease)
# Run with weft importable (DEVELOPERS.md: installed into a folder on PYTHONPATH) and from
# the checkout's root; runs write under /tmp/i25. nvidia-smi samples the device's memory
# in use (reserved memory and the CUDA context included) beside each run's own peak.
set -uo pipefail
dest=${OUT:-/tmp/i25-out}
work=/tmp/i25
out=$work/o  # packed into $dest/<stage>.tgz after each part (a part cut by the limit keeps the earlier ones)
mkdir -p "$dest" "$work" "$out"
pack() { tar czf "$dest/$stage.tgz" -C "$out" . ; echo "packed after $1 at ${SECONDS}s"; }
stage=${1:?stage a, b or c}
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
    timeout 400 python3 benchmarks/finetune_flow.py --out "$out" --work "$work/flow" > "$out/flow.log" 2>&1
    echo "flow rc=$?" | tee -a "$out/status.txt"; rm -rf "$work/flow"; tail -c 2500 "$out/flow.log"; pack flow
    timeout 150 python3 benchmarks/optimizer_step.py --out "$out" > "$out/optimizer.log" 2>&1
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
    timeout $((580 - SECONDS)) python3 benchmarks/train.py --out "$out/hf" --only 7b:32768 --steps 5 --skip-weft \
      > "$out/hf.log" 2>&1; echo "hf rc=$?" | tee -a "$out/status.txt"
    tail -n 12 "$out/hf.log"; pack hf ;;
  d)
    timeout 400 python3 benchmarks/optimizer_step.py --out "$out" --optimizers adamw_8bit,adamw_sr \
      > "$out/optimizer8.log" 2>&1; echo "optimizer8 rc=$?" | tee -a "$out/status.txt"
    grep -v Warning "$out/optimizer8.log" | tail -n 8; pack optimizer8 ;;
  e)
    run32 r32k-1 6 175
    run32 r32k-2 6 175
    run32 r32k-3 6 $((590 - SECONDS)) ;;
  f)
    timeout 400 python3 benchmarks/train.py --out "$out/hf" --only 7b:32768 --steps 5 --skip-weft \
      > "$out/hf.log" 2>&1; echo "hf rc=$?" | tee -a "$out/status.txt"
    tail -n 12 "$out/hf.log"; pack hf ;;
esac
