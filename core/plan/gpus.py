"""The GPU kinds the estimate knows (core/plan/estimate.py): memory, measured or scaled rates."""

from __future__ import annotations

import math

import attrs

from weft.core.plan.flops import PEAK_TFLOPS


@attrs.frozen(kw_only=True)
class GpuKind:
    name: str
    memory_gib: float  # what torch can allocate
    matmul_tflops: float  # bf16 GEMMs at these models' shapes
    attention_fwd_tflops: float
    attention_bwd_tflops: float  # at 32K tokens and below
    #: Element-wise work, copies and launches per token per decoder layer (seconds), fitted.
    overhead_s: float
    link_gbps: float  # GPU-to-GPU (NVLink) per direction, GB/s
    measured: bool  # rates measured on this kind (else scaled from the H200's by spec)
    peak_tflops: float = PEAK_TFLOPS["H200"]  # dense bf16 peak, for MFU (H100: the same)
    #: A float8 unit's products (its casts included) against bf16's, by scaling (``float8_recipe``),
    #: as measured end to end; a scaling not listed: bf16's rate.
    float8: tuple[tuple[str, float], ...] = ()
    #: The attention backward's rate at a longer sequence (tokens, TFLOP/s), where measured: between
    #: 32K and it the rate follows log2 of the length, past it it stays.
    attention_bwd_long: tuple[int, float] | None = None

    def attention_bwd_rate(self, tokens: float) -> float:
        """The attention backward's TFLOP/s over sequences of ``tokens``."""
        if self.attention_bwd_long is None or tokens <= 32768:
            return self.attention_bwd_tflops
        long_tokens, long_rate = self.attention_bwd_long
        reach = min(1.0, math.log2(tokens / 32768) / math.log2(long_tokens / 32768))
        return self.attention_bwd_tflops + reach * (long_rate - self.attention_bwd_tflops)

    def float8_speedup(self, recipe: str) -> float:
        """How much faster a unit's products run in float8 with ``recipe`` (1: not float8, or not measured)."""
        return dict(self.float8).get(recipe, 1.0)


#: Fitted to one H200 (BENCHMARKS.md, 2026-12-01/02): the 7B at 32K, the bundled layout, bf16
#: 4.09 s a step, tensorwise 3.28, rowwise_with_gw_hp 3.56, rowwise 3.99; the speed-up of the
#: decoder units' products (their recomputation's too) that gives each saving over the 2.06 s
#: the estimate counts for them in bf16. H100: the same tensor cores.
_HOPPER_FLOAT8 = (("tensorwise", 1.65), ("rowwise_with_gw_hp", 1.35), ("rowwise", 1.05))


GPUS = {
    # H200: measured (BENCHMARKS.md): GEMMs ~700 TFLOP/s, flash-attn-4 forward 640 and
    # backward 553 at 32K (the step's profile), 28 query / 4 KV heads, d 128; at 128K one
    # forward-and-backward call takes 694.7 ms a layer (620 TFLOP/s over both: "flash-attn-4 as
    # the ring's block kernel"), which with the forward at 640 leaves the backward at 613.
    "h200": GpuKind(name="h200", memory_gib=139.8, matmul_tflops=700.0, attention_fwd_tflops=640.0,
                    attention_bwd_tflops=553.0, overhead_s=6.4e-7, link_gbps=400.0, measured=True,
                    float8=_HOPPER_FLOAT8, attention_bwd_long=(131072, 613.0)),
    # H100 SXM: the same tensor cores and clock; 80 GB and 3.35 TB/s (element-wise work scaled;
    # the attention backward's rise with length as the H200's: 530 x 613 / 553).
    "h100": GpuKind(name="h100", memory_gib=79.1, matmul_tflops=680.0, attention_fwd_tflops=620.0,
                    attention_bwd_tflops=530.0, overhead_s=9.2e-7, link_gbps=400.0, measured=False,
                    float8=_HOPPER_FLOAT8, attention_bwd_long=(131072, 588.0)),
    # A100 80GB: 312 TFLOP/s bf16 peak, no flash-attn-4 (cuDNN / flash 2 rates), 2.0 TB/s.
    "a100-80g": GpuKind(name="a100-80g", memory_gib=79.1, matmul_tflops=240.0, attention_fwd_tflops=190.0,
                        attention_bwd_tflops=150.0, overhead_s=1.5e-6, link_gbps=250.0, measured=False,
                        peak_tflops=PEAK_TFLOPS["A100"]),
}
