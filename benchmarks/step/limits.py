"""What the measured kernel rates allow: issue 46's goals against the work each step must do.

    python3 benchmarks/step/limits.py            # the table, plain arithmetic (no GPU, no torch)

Each training row counts the matrix products and the attention kernels its recipe runs (the
recomputation its rules ask for included) at the best rates measured on one H200, and nothing
else: no element-wise kernel, no optimizer, no loss, no idle GPU. That is a floor no layout of
the same recomputation can beat; the goal's time minus the floor is what is left for all the
rest. The decoding row divides the bytes a token reads by the bandwidth the device copies at.
MFU is counted as the reports count it (core/plan/flops.py).

Rates (BENCHMARKS.md, one H200, bf16): matrix products 729-790 TFLOP/s at these shapes (issue
46's table; the planner fits 700 over whole steps); flash-attn-4 causal GQA, d 128, 32K-128K:
forward 640, backward 553 TFLOP/s at 32K (core/plan/gpus.py, measured); one forward-and-backward
call at 128K 620 TFLOP/s (694.7 ms a layer: "flash-attn-4 as the ring's block kernel"), used from
128K on. Memory: 4.3-4.8 TB/s (issue 46: what the decode kernels reach
and the copy bandwidth).
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from _bootstrap import ensure_weft  # noqa: E402

ensure_weft()

from weft.core.plan.flops import PEAK_TFLOPS, sequence_flops  # noqa: E402 - plain arithmetic, no torch

GEMM_BEST, ATTN_FWD, ATTN_BWD = 790e12, 640e12, 553e12
#: From 128K on: one flash-attn-4 forward and backward call, 694.7 ms a 7B layer (620 TFLOP/s counting
#: the backward as 2.5 forwards): the backward runs faster at length than the 32K figure above.
ATTN_CALL_LONG = 620e12
PEAK = PEAK_TFLOPS["H200"] * 1e12  # dense bf16, for MFU

#: (hidden, intermediate, layers, heads x head_dim, KV width, vocab): transformers' configs.
QWEN_7B = (3584, 18944, 28, 3584, 512, 152064)
QWEN_72B = (8192, 29568, 80, 8192, 1024, 152064)


def layer_params(shape) -> float:
    hidden, inter, _, attn, kv, _ = shape
    return hidden * (attn + 2 * kv) + attn * hidden + 3 * hidden * inter  # q, k, v, o; gate, up, down


def text_params(shape) -> float:
    """N of core/plan/flops.py: the decoder's layers and the head (no embedding)."""
    return shape[2] * layer_params(shape) + shape[0] * shape[5]


def attention_forward(shape, length: int) -> float:
    """Causal attention's forward FLOPs over all layers: 2 L^2 h per layer (QK and PV, half the square)."""
    return 2 * length**2 * shape[3] * shape[2]


def mfu_flops(shape, length: int) -> float:
    """The FLOPs the reports count MFU by (core/plan/flops.py)."""
    return sequence_flops(params=text_params(shape), layers=shape[2], hidden=shape[3], length=length)


def training_floor(shape, length: int, *, recomputed_flops: float, attention_again: int = 0,
                   frozen: float = 0) -> float:
    """Seconds of products and attention kernels alone: 6 FLOPs a weight and token (4 for a frozen
    one), the recomputed products, attention forward (``attention_again`` more times over
    recomputed layers' share) and backward (2.5x the forward)."""
    products = (6 * text_params(shape) - 2 * frozen) * length + recomputed_flops
    fwd = attention_forward(shape, length)
    once = 3.5 * fwd / ATTN_CALL_LONG if length >= 131072 else fwd / ATTN_FWD + 2.5 * fwd / ATTN_BWD
    return products / GEMM_BEST + once + fwd * attention_again / ATTN_FWD


def rows() -> list[tuple[str, str, str, str]]:
    out = []
    # 7B at 128K, bundled: every layer recomputed except its attention kernel (except_attention),
    # its MLP by hand: the down product not made again (strategies/memory/swiglu.py).
    n = 131072
    down = QWEN_7B[0] * QWEN_7B[1]
    floor = training_floor(QWEN_7B, n, recomputed_flops=2 * n * QWEN_7B[2] * (layer_params(QWEN_7B) - down))
    goal = mfu_flops(QWEN_7B, n) / (0.55 * PEAK)
    out.append(("7B 128K bf16, recomputed but for attention", f"55% MFU: a step of {goal:.2f} s",
                f"{floor:.2f} s (MFU {mfu_flops(QWEN_7B, n) / floor / PEAK:.1%})",
                f"{goal - floor:.2f} s for everything else (measured 2026-12-02: 31.7 s, 50.7%, the down "
                "product made again; by hand ~0.59 s less, BENCHMARKS.md)"))
    no_redo = training_floor(QWEN_7B, n, recomputed_flops=0)
    out.append(("the same, nothing recomputed (does not fit: 15 GB of MLP activations a layer)", "",
                f"{no_redo:.2f} s (MFU {mfu_flops(QWEN_7B, n) / no_redo / PEAK:.1%})", ""))
    # 7B at 32K, bundled: layers 0-9 keep everything, 10-27 recompute their MLP's gate and up.
    n = 32768
    hidden, inter = QWEN_7B[0], QWEN_7B[1]
    floor = training_floor(QWEN_7B, n, recomputed_flops=18 * 2 * n * 2 * hidden * inter)
    goal = n / (1.5 * 6026)
    out.append(("7B 32K bf16, 18 layers recompute the MLP", f"1.5x plain transformers' 6,026 tok/s: {goal:.3f} s",
                f"{floor:.3f} s ({n / floor:,.0f} tok/s)",
                f"{goal - floor:.3f} s for everything else (measured 2026-12-02: 4.04 s)"))
    # 72B QLoRA at 128K, bundled: a frozen 4-bit base, every layer recomputed (attention too), its
    # MLP in tiles by hand: the tiles' down product not made again.
    n = 131072
    base = QWEN_72B[2] * layer_params(QWEN_72B)
    redone = base - QWEN_72B[2] * QWEN_72B[0] * QWEN_72B[1]
    floor = training_floor(QWEN_72B, n, recomputed_flops=2 * n * redone, attention_again=1, frozen=base)
    out.append(("72B QLoRA 128K, every layer recomputed", "240 s", f"{floor:.1f} s (bf16 products, "
                "no dequantisation, no adapters)", f"{240 - floor:.1f} s for everything else "
                "(measured: 314.4 s)"))
    keep = 2 * n * QWEN_72B[3] * QWEN_72B[2] / 2**30  # each layer's attention output kept, bf16
    out.append(("the same keeping each attention's output (no second attention forward)", "",
                f"{training_floor(QWEN_72B, n, recomputed_flops=2 * n * redone, frozen=base):.1f} s",
                f"needs {keep:.0f} GiB more (GPU: 129 of 140 in use; host: 105 of 125)"))
    # Decoding at 128K: the weights a token reads and the cache.
    weights, cache = 14.14e9, 7.53e9  # `weft generate --json`: weight_bytes_per_rank, cache_bytes_per_rank (128K)
    for rate in (4.3e12, 4.8e12):
        out.append((f"`weft generate` 128K, {rate / 1e12:.1f} TB/s", "6.0 ms a token",
                    f"{(weights + cache) / rate * 1e3:.2f} ms", f"reads {(weights + cache) / 6e-3 / 1e12:.2f} TB/s "
                    "at 6.0 ms (measured 2026-12-06: 6.48 ms fused, H200)"))
    return out


def main() -> None:
    print("| row | goal | floor: products and attention kernels only | left |")
    print("| --- | --- | --- | --- |")
    for row in rows():
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
