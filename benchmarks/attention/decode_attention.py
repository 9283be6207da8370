"""Decode attention on one GPU: the Triton split-KV kernel against the plain-torch split-KV.

One query token per row over a preallocated bf16 cache (Qwen2.5-VL-7B's attention: 28 query
over 4 KV heads, head_dim 128), every cache row visible. Each variant runs as a decoding step
does: one call per layer over ``--layers`` distinct caches (the whole step's cache, so nothing
is served from L2), captured in one CUDA graph and replayed ``--iters`` times after a warm-up,
timed with CUDA events; the eager (uncaptured) time per call comes too. GB/s counts the cache
read once per call: 2 (K and V) x B x Hkv x N x D x 2 bytes. Each variant's output is checked
against a float32 reference (the torch version over float32 copies, TF32 off), at the full
length and at a ragged one.

    python3 benchmarks/attention/decode_attention.py [--out DIR] [--sweep] [--sweep-merge]

``--sweep`` also times the Triton kernel over block rows, warps, stages and waves (its
``CONFIG``), the fastest first; ``--sweep-merge`` the merge's launch (splits a load, head columns
and warps a program) with and without programmatic dependent launch of the pair.
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from _bootstrap import ensure_weft  # noqa: E402

ensure_weft()

import torch  # noqa: E402

from weft.strategies.attention.decode_split import split_decode_attention, split_rows  # noqa: E402
from weft.strategies.attention.kernels import decode_triton  # noqa: E402


def variants(n: int) -> dict:
    splits = split_rows(n)[1]
    return {
        "triton": lambda q, k, v, lengths, scale: decode_triton.triton_decode_attention(
            q, k, v, lengths=lengths, scale=scale),
        "torch_split": lambda q, k, v, lengths, scale: split_decode_attention(
            q, k, v, lengths=lengths, scale=scale, splits=splits),
    }


def timed_graph(fn, queries, caches, lengths, scale, *, iters: int) -> float:
    """Seconds per call: one call per layer captured in a CUDA graph, replayed ``iters`` times."""
    for _ in range(3):  # warm-up: Triton's compile, cuBLAS's handles, the allocator, outside any capture
        for q, (k, v) in zip(queries, caches):
            fn(q, k, v, lengths, scale)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for q, (k, v) in zip(queries, caches):  # the warm-up a capture wants on its own stream
            fn(q, k, v, lengths, scale)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        for q, (k, v) in zip(queries, caches):
            fn(q, k, v, lengths, scale)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / iters / len(caches)


def timed_eager(fn, queries, caches, lengths, scale, *, iters: int) -> float:
    """Seconds per call, launched from Python (the host's overhead included)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        for q, (k, v) in zip(queries, caches):
            fn(q, k, v, lengths, scale)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / iters / len(caches)


def errors(fn, q, k, v, scale, lengths_list) -> float:
    """Max abs difference from the float32 reference over ``lengths_list`` ((B,) tensors)."""
    worst = 0.0
    for lengths in lengths_list:
        want = split_decode_attention(q.float(), k.float(), v.float(), lengths=lengths, scale=scale,
                                      splits=split_rows(k.shape[2])[1])
        worst = max(worst, (fn(q, k, v, lengths, scale).float() - want).abs().max().item())
    return worst


def make(batch: int, hq: int, hkv: int, n: int, d: int, layers: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    queries = [torch.randn(batch, hq, 1, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(layers)]
    caches = [tuple(torch.randn(batch, hkv, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
                    for _ in range(2)) for _ in range(layers)]
    return queries, caches


#: The split kernel's CONFIG grid (``--sweep``) and the merge's launch with PDL of the pair (``--sweep-merge``).
SPLIT_GRID = {"BLOCK_N": (32, 64, 128), "num_warps": (4, 8), "num_stages": (2, 3, 4), "waves": (1, 2, 4)}
MERGE_GRID = {"merge_block_s": (16, 64, 128), "merge_block_d": (32, 128), "merge_warps": (1, 4, 8),
              "pdl": (False, True)}


def sweep(queries, caches, lengths, scale, *, iters: int, grid: dict = SPLIT_GRID) -> list[dict]:
    """The Triton kernel over every combination of ``grid``'s CONFIG values (the rest as configured),
    each checked against the reference; the fastest first."""
    base = dict(decode_triton.CONFIG)
    fn = variants(caches[0][0].shape[2])["triton"]
    q, (k, v) = queries[0], caches[0]
    want = split_decode_attention(q.float(), k.float(), v.float(), lengths=lengths, scale=scale,
                                  splits=split_rows(k.shape[2])[1])
    rows = []
    for values in itertools.product(*grid.values()):
        config = dict(zip(grid, values))
        decode_triton.CONFIG.update(base, **config)
        try:
            err = (fn(q, k, v, lengths, scale).float() - want).abs().max().item()
            seconds = timed_graph(fn, queries, caches, lengths, scale, iters=iters)
        except Exception as error:  # past the shared memory, a launch this Triton refuses: reported, not fatal
            print(f"{config}: {type(error).__name__}: {str(error)[:200]}")
            continue
        rows.append({**config, "us": seconds * 1e6, "max_abs_err": err})
    decode_triton.CONFIG.update(base)
    return sorted(rows, key=lambda r: r["us"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16384, 131072], help="cache rows N")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, nargs=2, default=[28, 4], metavar=("HQ", "HKV"))
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=28, help="distinct caches, one call each per step")
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--sweep", action="store_true", help="also time the Triton kernel's configs")
    parser.add_argument("--sweep-merge", action="store_true", help="also time the merge's launch and PDL")
    parser.add_argument("--out", type=pathlib.Path, help="folder for decode_attention.json / .md")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or not decode_triton.triton_decode_available("cuda"):
        print("decode_attention.py needs a CUDA GPU and Triton", file=sys.stderr)
        return 1
    (hq, hkv), d, b = args.heads, args.head_dim, args.batch
    table, sweeps, merges = [], {}, {}
    for n in args.rows:
        queries, caches = make(b, hq, hkv, n, d, args.layers)
        scale = d ** -0.5
        full = torch.full((b,), n, device="cuda", dtype=torch.long)
        ragged = torch.tensor([n // 3 + 5] + [n - 1] * (b - 1), device="cuda", dtype=torch.long)
        gbytes = 2 * b * hkv * n * d * 2 / 1e9
        for name, fn in variants(n).items():
            err = errors(fn, queries[0], *caches[0], scale, [full, ragged])
            graph = timed_graph(fn, queries, caches, full, scale, iters=args.iters)
            eager = timed_eager(fn, queries, caches, full, scale, iters=max(1, args.iters // 10))
            table.append({"variant": name, "rows": n, "batch": b, "us_graph": graph * 1e6, "us_eager": eager * 1e6,
                          "GB/s": gbytes / graph, "ms_per_token": graph * args.layers * 1e3, "max_abs_err": err})
            print(json.dumps(table[-1]), flush=True)
        if args.sweep:
            sweeps[n] = sweep(queries, caches, full, scale, iters=max(1, args.iters // 5))
            for row in sweeps[n][:8]:
                print(f"sweep N={n}", json.dumps(row), flush=True)
        if args.sweep_merge:
            merges[n] = sweep(queries, caches, full, scale, iters=max(1, args.iters // 5), grid=MERGE_GRID)
            for row in merges[n]:
                print(f"merge N={n}", json.dumps(row), flush=True)
        del queries, caches
        torch.cuda.empty_cache()
    lines = [f"B={b}, Hq={hq}, Hkv={hkv}, D={d}, bf16, {args.layers} layers, "
             f"{torch.cuda.get_device_name()}", "",
             "| variant | N | us/call (graph) | us/call (eager) | GB/s | ms/token | max abs err |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['rows']} | {r['us_graph']:.1f} | {r['us_eager']:.1f} | {r['GB/s']:.0f} "
              f"| {r['ms_per_token']:.2f} | {r['max_abs_err']:.1e} |" for r in table]
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        found = {"table": table, "sweep": sweeps, "merge": merges}
        (args.out / "decode_attention.json").write_text(json.dumps(found, indent=1))
        (args.out / "decode_attention.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
