#!/usr/bin/env bash
# Issue 15's and 28's GPU rows: Qwen2.5-VL-7B (random init) prefilling a 128K-token prompt (one
# 448x448 image, the rest synthetic text: the bundled 128K recipe's own first sample) and
# decoding 100 tokens: plain transformers' `generate` first (benchmarks/decode/hf_generate.py, same
# shapes, its dynamic cache), then weft with the static cache
# (benchmarks/decode/variants/7b-128k-static-cache.toml), a batch of 8 prompts of 16K tokens against
# one of them, the dynamic and paged caches (benchmarks/decode/variants/7b-128k-paged-cache.toml); the
# two-GPU rows (ring 2, sharded cache) where two GPUs are visible. Rows in the order a short
# lease should get them. Run from a scratch folder with weft installed (the checkout's weft/
# would shadow it):
#   cd "$(mktemp -d)" && bash <checkout>/benchmarks/decode/generate_long.sh [28|28a|28f|28p|28x|15|all]   # OUT=... for the JSON
# 28: issue 28's lines: plain transformers, the static cache as shipped (Triton's split-KV
# attention, the step compiled and captured), the 16K batch (the eager path: 28a, 28x);
# 28p: the 128K step as shipped under torch.profiler (--profile), its kernels by device time;
# 28x: what each part buys (the compiled step without its graph, the graph without the
# compiled step, the plain-torch split-KV, plain transformers' static cache); 15:
# flash-attn-4's decode (Blackwell), the dynamic and paged caches' (and the two-GPU ones);
# 28a: the fast path's numerics at 16K: the fast and eager paths in bf16, the graph without the
# compiled step, each row against the eager one; 28f: the same in float32 too (the reference,
# each row against float32's eager; 2026-12-01: bf16's own rounding parts from it at the first
# token on random weights);
# 28l: longer prompts through the static cache as shipped, 256K and 512K tokens, 20 new tokens
# (whether the whole prompt's prefill fits one H200 without chunking, and the step's cost there),
# 512K prefilled in chunks of 64K, 128K in chunks of 32K;
# 28u: the static cache as shipped (q/k/v and gate/up fused) beside the same with
# --no-fused-projections, timed, and the device's copy bandwidth measured in the same command:
# the GB/s a token's step achieves against it; 28up: the same two under the profiler;
# all (the default): every group. The table covers whatever rows the folder holds.
set -uo pipefail
rows=${1:-all}
out="${OUT:-generate-long}"
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
common=(qwen2.5-vl-7b-128k-1gpu --prompt-from-data --max-new-tokens 100 --warmup --json)
static=("$here/variants/7b-128k-static-cache.toml" "${common[@]:1}")
ruled() {  # $1 the variant's path, $2 the static cache rule's extra keys: one recipe, the rule changed
  sed "s/kv_cache = { strategy = \"static\" }/kv_cache = { strategy = \"static\", $2 }/" \
    "$here/variants/7b-128k-static-cache.toml" > "$1"
  grep -q "$2" "$1" || { echo "generate_long.sh: the static cache's rule not found in the variant" >&2; exit 1; }
}
case "$rows" in 28|all) ;; 28a|28f|28l|28p|28x|28u|28up|15) ;; *) echo "generate_long.sh: rows 28, 28a, 28f, 28l, 28p, 28x, 28u, 28up, 15 or all, not $rows" >&2; exit 2 ;; esac
if [ "$rows" = 28a ] || [ "$rows" = 28f ] || [ "$rows" = all ]; then
# The same 16K prompt through each path; float32 (weights stored and computed so, the prefill
# and the vision tower through torch's SDPA: flash-attn-4 takes no float32) is the reference every bf16 row is
# judged against, and the float32 fast path against the float32 eager one tells a compiled
# step's error from bf16's own rounding.
sixteen=(--prompt-from-data --set data.tokens=16384 --set train.micro_batch_tokens=16384 --max-new-tokens 100 --warmup
         --json --nproc 1)
ruled "$out/a-uncompiled.toml" 'compile_step = false'
sed 's/storage_dtype = "bfloat16"/storage_dtype = "float32"/' "$here/variants/7b-128k-static-cache.toml" > "$out/a-fp32.toml"
printf '\n[[rules]]\nname = "float32: torch SDPA (text and vision)"\nattention = { strategy = "sdpa" }\n' >> "$out/a-fp32.toml"
sed 's/kv_cache = { strategy = "static" }/kv_cache = { strategy = "static", compile_step = false }/' "$out/a-fp32.toml" \
  > "$out/a-fp32-uncompiled.toml"
if [ -s "$out/16k-one.json" ]; then cp "$out/16k-one.json" "$out/a-fast.json"  # 28's 16K row: this one
else timeout 300 python3 -m weft generate "$here/variants/7b-128k-static-cache.toml" "${sixteen[@]}" > "$out/a-fast.json" 2> "$out/a-fast.err"
fi
timeout 300 python3 -m weft generate "$out/a-uncompiled.toml" "${sixteen[@]}" --no-cuda-graph > "$out/a-eager.json" 2> "$out/a-eager.err"
if [ "$rows" != 28a ]; then
timeout 300 python3 -m weft generate "$out/a-fp32-uncompiled.toml" "${sixteen[@]}" --set train.precision=fp32 --no-cuda-graph \
  > "$out/a-fp32-eager.json" 2> "$out/a-fp32-eager.err"
timeout 300 python3 -m weft generate "$out/a-fp32.toml" "${sixteen[@]}" --set train.precision=fp32 > "$out/a-fp32-fast.json" 2> "$out/a-fp32-fast.err"
fi
timeout 300 python3 -m weft generate "$out/a-uncompiled.toml" "${sixteen[@]}" > "$out/a-graph.json" 2> "$out/a-graph.err"
python3 - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = {}
for name in ("a-fp32-eager", "a-fp32-fast", "a-eager", "a-graph", "a-fast"):
    try:
        rows[name] = json.loads((out / f"{name}.json").read_text())
    except (OSError, ValueError):
        print(f"{name}: not run or FAILED (see {name}.err)")
against = "a-fp32-eager" if "a-fp32-eager" in rows else "a-eager"  # 28a: bf16's eager path the reference
ref = rows.get(against)
print(f"| row (16K prompt) | step compiled | graph | graphs, breaks | tokens as {against} | first differs | max abs dlogprob over the shared prefix | dlogprob at token 1 | graph ms/token |")
print("|---|---|---|---|---:|---:|---:|---:|---:|")
for name, r in rows.items():
    if ref is None:
        break
    pairs = list(zip(r["tokens"], ref["tokens"]))
    first = next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs))
    shared = [abs(a - b) for a, b in zip(r["logprobs"][:first + 1], ref["logprobs"][:first + 1])]
    print(f"| {name} | {r.get('step_compiled')} | {r.get('cuda_graph')} | {r.get('step_graphs')}, {r.get('step_graph_breaks')} | "
          f"{sum(a == b for a, b in pairs)} of {len(pairs)} | {first} | {max(shared):.2e} | {abs(r['logprobs'][1] - ref['logprobs'][1]):.2e} | "
          f"{r.get('graph_ms_per_token') or '-'} |")
for a, b in (("a-fast", "a-eager"), ("a-graph", "a-eager"), ("a-fp32-fast", "a-fp32-eager")):
    if a in rows and b in rows:
        same = sum(x == y for x, y in zip(rows[a]["tokens"], rows[b]["tokens"]))
        print(f"{a} against {b}: {same} of {len(rows[a]['tokens'])} tokens the same")
for name, r in rows.items():
    if r.get("step_graph_break"):
        print(f"{name}: first graph break: {r['step_graph_break']}")
PY
fi
if [ "$rows" = 28 ] || [ "$rows" = all ]; then
# Each row under a timeout: a hung compilation costs its row, not the lease.
timeout 300 python3 "$here/hf_generate.py" --preset qwen2_5_vl_7b --tokens 131072 --new 100 > "$out/hf.json" 2> "$out/hf.err"
# The static cache as shipped: Triton's split-KV attention, the step compiled, then captured.
timeout 420 python3 -m weft generate "${static[@]}" --nproc 1 > "$out/one-static.json" 2> "$out/one-static.err"
# (The eager path the fast one must equal: 28a's 16K rows; at 128K in 28x.)
# The batch row: 8 prompts of 16K tokens decoded together, against one of them alone (both
# through the static cache, which the batch path always uses).
short=(--set data.tokens=16384 --set train.micro_batch_tokens=16384 --max-new-tokens 100 --warmup --json --nproc 1)
if [ -s "$out/a-fast.json" ]; then cp "$out/a-fast.json" "$out/16k-one.json"  # 28a's fast row: this one
else timeout 300 python3 -m weft generate "$here/variants/7b-128k-static-cache.toml" --prompt-from-data 1 "${short[@]}" \
  > "$out/16k-one.json" 2> "$out/16k-one.err"; fi
timeout 300 python3 -m weft generate "$here/variants/7b-128k-static-cache.toml" --prompt-from-data 8 "${short[@]}" \
  > "$out/16k-eight.json" 2> "$out/16k-eight.err"
fi
if [ "$rows" = 28l ] || [ "$rows" = all ]; then
# Longer prompts, the whole prompt prefilled at once: its peak says where chunking is needed;
# 512K in chunks of 64K beside it, and 128K in chunks of 32K (what chunking costs where it is not needed).
long() {  # $1 the row, $2 the recipe, $3 the prompt's K tokens
  timeout 420 python3 -m weft generate "$2" --prompt-from-data --set data.tokens=$(($3 * 1024)) \
    --set train.micro_batch_tokens=$(($3 * 1024)) --max-new-tokens 20 --json --nproc 1 > "$out/$1.json" 2> "$out/$1.err"
}
ruled "$out/chunked-64k.toml" 'prefill_chunk_tokens = 65536'
ruled "$out/chunked-32k.toml" 'prefill_chunk_tokens = 32768'
long long-256k "$here/variants/7b-128k-static-cache.toml" 256
long long-512k-chunked "$out/chunked-64k.toml" 512
long long-512k "$here/variants/7b-128k-static-cache.toml" 512
long long-128k-chunked "$out/chunked-32k.toml" 128
fi
if [ "$rows" = 28p ] || [ "$rows" = all ]; then
# Where a 128K step's time goes: the static cache as shipped under torch.profiler (--profile:
# its own row, as the profiler's per-kernel bookkeeping would be in the timed rows' figures).
timeout 420 python3 -m weft generate "${static[@]}" --nproc 1 --profile "$out/profile-128k" \
  > "$out/one-static-profiled.json" 2> "$out/one-static-profiled.err"
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('128K step:', d['ms_per_step'], 'ms of kernels');
[print(f\"{k['per_step_us']:9.1f} us {k['calls']:6d}x {k['kernel'][:110]}\") for k in d['kernels'][:25]]" \
  "$out/profile-128k/decode_profile.json" 2>/dev/null || echo "profile: not written (see one-static-profiled.err)"
fi
if [ "$rows" = 28u ] || [ "$rows" = all ]; then
# Fused projections or not, one after the other in the same command (the machines are noisy),
# then each under the profiler (its own rows: the profiler's bookkeeping stays out of the timings).
python3 -c "
import json, torch
a = torch.empty(2**31, dtype=torch.uint8, device='cuda'); b = torch.empty_like(a)
for _ in range(3): b.copy_(a)
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
for _ in range(20): b.copy_(a)
end.record(); torch.cuda.synchronize()
print(json.dumps({'copy_gb_per_s': 2 * 20 * a.numel() / (start.elapsed_time(end) / 1e3) / 1e9,
                  'device': torch.cuda.get_device_name()}))" > "$out/copy-bandwidth.json" 2> "$out/copy-bandwidth.err"
timeout 420 python3 -m weft generate "${static[@]}" --nproc 1 > "$out/one-static.json" 2> "$out/one-static.err"
timeout 420 python3 -m weft generate "${static[@]}" --nproc 1 --no-fused-projections \
  > "$out/one-static-unfused.json" 2> "$out/one-static-unfused.err"
fi
if [ "$rows" = 28up ] || [ "$rows" = all ]; then
for variant in "" --no-fused-projections; do
  name=profile-128k${variant:+-unfused}
  timeout 420 python3 -m weft generate "${static[@]}" --nproc 1 $variant --profile "$out/$name" \
    > "$out/$name.json" 2> "$out/$name.err"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], 'step:', d['ms_per_step'], 'ms of kernels');
[print(f\"{k['per_step_us']:9.1f} us {k['calls']:6d}x {k['kernel'][:110]}\") for k in d['kernels'][:25]]" \
    "$out/$name/decode_profile.json" "$name" 2>/dev/null || echo "$name: not written (see $name.err)"
done
fi
if [ "$rows" = 28x ] || [ "$rows" = all ]; then
ruled "$out/static-uncompiled.toml" 'compile_step = false'
# The eager path at 128K: no compiled step, no CUDA graph (the same Triton attention).
timeout 300 python3 -m weft generate "$out/static-uncompiled.toml" "${common[@]:1}" --nproc 1 --no-cuda-graph \
  > "$out/one-static-eager.json" 2> "$out/one-static-eager.err"
# The same compiled step launched without its graph: the graph's own effect on the tokens (none).
timeout 420 python3 -m weft generate "${static[@]}" --nproc 1 --no-cuda-graph \
  > "$out/one-static-nograph.json" 2> "$out/one-static-nograph.err"
# What each part buys: the graph without the compiled step (its prefill through cuDNN's
# attention instead of flash-attn-4's: the prefill's other kernel, measured on the side; its
# tokens may part from the others' with its prompt's keys); the plain-torch split-KV attention.
{ cat "$out/static-uncompiled.toml"; printf '\n[[rules]]\nname = "the prefill through cuDNN"\nwhen = { modality = "text" }\nattention = { strategy = "auto", backend = "cudnn" }\n'; } \
  > "$out/static-uncompiled-cudnn.toml"
timeout 300 python3 -m weft generate "$out/static-uncompiled-cudnn.toml" "${common[@]:1}" --nproc 1 \
  > "$out/one-static-uncompiled.json" 2> "$out/one-static-uncompiled.err"
ruled "$out/static-split.toml" 'decode_kernel = "split"'
timeout 420 python3 -m weft generate "$out/static-split.toml" "${common[@]:1}" --nproc 1 \
  > "$out/one-static-split.json" 2> "$out/one-static-split.err"
# Plain transformers with its own static cache (its fast path where the model allows compiling).
timeout 400 python3 "$here/hf_generate.py" --preset qwen2_5_vl_7b --tokens 131072 --new 100 --cache static \
  > "$out/hf-static.json" 2> "$out/hf-static.err"
fi
if [ "$rows" = 15 ] || [ "$rows" = all ]; then
# flash-attn-4's split-KV decode in place of weft's (benchmarks/decode/variants/7b-128k-static-flash.toml).
# (Blackwell only: flash-attn-4 4.0.0b36's split-KV stops on SM 9.0, BENCHMARKS.md.)
if python3 -c "import sys, torch; sys.exit(torch.cuda.get_device_capability()[0] < 10)"; then
  python3 -m weft generate "$here/variants/7b-128k-static-flash.toml" "${common[@]:1}" --nproc 1 \
    > "$out/one-static-flash.json" 2> "$out/one-static-flash.err"
fi
# transformers' dynamic cache by rule (the default one process is the static cache now).
sed 's/kv_cache = { strategy = "static" }/kv_cache = { strategy = "dynamic" }/' \
  "$here/variants/7b-128k-static-cache.toml" > "$out/dynamic.toml"
timeout 420 python3 -m weft generate "$out/dynamic.toml" "${common[@]:1}" --nproc 1 > "$out/one.json" 2> "$out/one.err"
paged=("$here/variants/7b-128k-paged-cache.toml" "${common[@]:1}")
python3 -m weft generate "${paged[@]}" --nproc 1 > "$out/one-paged.json" 2> "$out/one-paged.err"
if [ "$gpus" -ge 2 ]; then
  python3 -m weft generate "${common[@]}" --nproc 2 --set parallel.ring=2 > "$out/two.json" 2> "$out/two.err"
  python3 -m weft generate "${paged[@]}" --nproc 2 --set parallel.ring=2 > "$out/two-paged.json" 2> "$out/two-paged.err"
fi
fi
python3 - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = {}
for name in ("hf", "hf-static", "one-static", "one-static-unfused", "long-128k-chunked", "long-256k", "long-512k", "long-512k-chunked", "one-static-eager", "one-static-nograph", "one-static-uncompiled", "one-static-split", "one-static-flash",
             "one", "one-paged", "two", "two-paged"):
    try:
        rows[name] = json.loads((out / f"{name}.json").read_text())
    except (OSError, ValueError):
        print(f"{name}: not run or FAILED (see {name}.err)")
print("| runner | GPUs | cache | prompt | prefill s | prefill tok/s | decode ms/token | graph ms/token | graph pool MiB | cache GiB per GPU | peak GiB |")
print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
for name, r in rows.items():
    cache = ", ".join(f"{b / 2**30:.2f}" for b in r.get("cache_bytes_per_rank", []))
    graph = (f"{r['graph_ms_per_token']:.2f} | {r['graph_pool_bytes'] / 2**20:,.0f}" if r.get("cuda_graph")
             else f"— ({r.get('cuda_graph_off') or 'no graph'}) | —")
    print(f"| {r.get('runner', 'weft generate')} | {r['world_size']} | {r['cache']} | {r['prompt_tokens']:,} | "
          f"{r['prefill_s']:.2f} | {r['prefill_tokens_per_s']:,.0f} | {r['decode_ms_per_token']:.1f} | {graph} | "
          f"{cache} | {r['max_memory_gib']:.1f} |")
for name, r in rows.items():  # the one-time work the per-token figure leaves out, and all of it in
    if r.get("decode_wall_s") is not None:
        print(f"{name}: set-up {r['decode_setup_s']:.3f} s, first step {r.get('first_step_s') or 0:.3f} s, "
              f"capture {r.get('graph_capture_s') or 0:.3f} s; after the prefill {r['decode_wall_s']:.2f} s in all, "
              f"{1e3 * r['decode_wall_s'] / max(len(r.get('tokens', [])) - 1, 1):.1f} ms a token with it")
if "one" in rows and "two" in rows:
    print(f"prefill speed-up on two: {rows['one']['prefill_s'] / rows['two']['prefill_s']:.2f}x; "
          f"same tokens: {rows['one']['tokens'] == rows['two']['tokens']}")
try:
    one, eight = (json.loads((out / f"16k-{n}.json").read_text()) for n in ("one", "eight"))
    single = 1e3 / one["decode_ms_per_token"]
    print(f"16K x 8 together: {eight['decode_tokens_per_s']:,.0f} tokens/s against one prompt's {single:,.0f} "
          f"({eight['decode_tokens_per_s'] / single:.2f}x); first answer as alone: "
          f"{eight['answers'][0]['tokens'] == one['tokens']}")
except (OSError, ValueError, KeyError) as error:
    print(f"16K batch: FAILED ({error}; see 16k-*.err)")
if "hf" in rows and "one-static" in rows:
    print(f"static cache against plain transformers: decode {rows['hf']['decode_ms_per_token'] / rows['one-static']['decode_ms_per_token']:.2f}x, "
          f"prefill {rows['hf']['prefill_s'] / rows['one-static']['prefill_s']:.2f}x")
if "one-static" in rows and "one-static-flash" in rows:
    same = sum(a == b for a, b in zip(rows["one-static"]["tokens"], rows["one-static-flash"]["tokens"]))
    print(f"flash-attn-4 decode against weft's split-KV: {same} of {len(rows['one-static']['tokens'])} tokens the same")
try:
    copy = json.loads((out / "copy-bandwidth.json").read_text())
    print(f"device copy bandwidth: {copy['copy_gb_per_s']:,.0f} GB/s ({copy['device']})")
except (OSError, ValueError):
    copy = None
for name, r in rows.items():  # the bytes a replayed step reads, and the rate it reads them at
    if r.get("weight_bytes_per_rank") and r.get("graph_ms_per_token"):
        read = r["weight_bytes_per_rank"] + r["cache_bytes_per_rank"][0]
        rate = read / (r["graph_ms_per_token"] / 1e3) / 1e9
        share = f", {rate / copy['copy_gb_per_s']:.0%} of the copy bandwidth" if copy else ""
        print(f"{name}: {r.get('fused_projection_groups', 0)} groups fused; reads {r['weight_bytes_per_rank'] / 1e9:.2f} GB "
              f"of weights + {r['cache_bytes_per_rank'][0] / 1e9:.2f} GB of cache a token: {rate:,.0f} GB/s replayed{share}")
for name in ("one-static-eager", "one-static-nograph", "one-static-uncompiled", "one-static-split", "one-static-unfused"):
    if "one-static" in rows and name in rows:
        same = sum(a == b for a, b in zip(rows["one-static"]["tokens"], rows[name]["tokens"]))
        first = next((i for i, (a, b) in enumerate(zip(rows["one-static"]["tokens"], rows[name]["tokens"])) if a != b),
                     None)
        print(f"the fast step against {name}: {same} of {len(rows['one-static']['tokens'])} tokens the same "
              f"(first difference at {first})")
for name, r in rows.items():
    if r.get("step_compiled") is not None:
        print(f"{name}: step compiled {r['step_compiled']} ({r.get('step_compile_s') or r.get('step_compile_off')}; "
              f"{r.get('step_graphs')} graphs, {r.get('step_graph_breaks')} breaks {r.get('step_graph_break') or ''}), "
              f"graph {r.get('cuda_graph')} ({r.get('graph_capture_s') or r.get('cuda_graph_off')})")
for name in ("one-paged", "two-paged", "one-static"):
    if name in rows and "one" in rows:
        print(f"{name}: same tokens as the dynamic cache: {rows[name]['tokens'] == rows['one']['tokens']}")
PY
