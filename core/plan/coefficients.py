"""The memory model's coefficients: what depends on kernels, not arithmetic (what a layer saves,
what a recomputation holds at once, what a loss works in), each fitted to measured runs named
beside it. The arithmetic that uses them: core/plan/estimate.py."""

from __future__ import annotations

GIB = 2**30

#: What one decoder layer keeps from its forward to its backward, in units of the layer's
#: input (tokens x hidden x 2 bytes), by checkpoint mode; "off" and "attention" add the
#: MLP's intermediates (``MLP_SAVED`` x tokens x intermediate x 2 bytes). Fitted to 7B on
#: one H200 (32K: "mlp" 0.86 GiB per layer, "off" +3.47 GiB; 128K: "except_attention").
LAYER_SAVED = {"full": 1.0, "except_attention": 2.0, "mlp": 3.9, "attention": 2.0, "off": 3.9}
MLP_SAVED = 3.0
#: A compiled float8 MLP whose scaling casts its weight gradient's operands (tensorwise,
#: rowwise) keeps one intermediate fewer: the partitioner makes the down projection's input
#: again from the two it keeps (torchao's emulation, compiled, on the CPU: 2 of 3 saved; bf16
#: and rowwise_with_gw_hp keep 3). Measured at 32K on one H200: tensorwise 116.9 GiB against
#: bf16's and gw_hp's 132.6 (10 such layers; this counts 11.6 of the 15.7 GiB: an upper bound).
FLOAT8_MLP_SAVED = {"tensorwise": 2.0, "rowwise": 2.0}
#: One layer's recomputation in the backward holds at once about ``RECOMPUTE_ATTENTION``
#: layer inputs' worth (q, k, v, out; a float32 norm) and ``RECOMPUTE_MLP`` x tokens x
#: intermediate x 2 bytes: the MLP's four intermediates (gate, up, the activation and its
#: gradient) in a compiled module's backward (float8's). Measured: a snapshot at the 7B 128K
#: 4-layer slice's peak (H100, issue 46), 4.03 and 4.3 for "except_attention". A tiled MLP (``mlp_tile_tokens``)
#: holds one tile's, ``TILED_RECOMPUTE_MLP`` of them: fitted to the frontier rows (7B, 128K to
#: 512K) and the 72B QLoRA slice.
RECOMPUTE_ATTENTION = 4.0
RECOMPUTE_MLP = 4.0
TILED_RECOMPUTE_MLP = 1.6
#: The same for an untiled MLP made again by hand (a SwiGLU of plain linear layers,
#: strategies/memory/swiglu.py): gate, up and h, then gate, up and h's gradient, which the
#: backward writes the gate's and up's gradients over. Measured: the 7B 128K 4-layer slice on one
#: H100 (2026-12-06, session 8), 44.47 GiB against 49.09 through the compiled module: one
#: intermediate (4.62 GiB) fewer.
BY_HAND_RECOMPUTE_MLP = 3.0
#: The same MLP term for a float8 layer made again whole ("except_attention", "full"): its
#: casts' float8 copies (and rowwise's transposed ones) beside the bf16 intermediates. Fitted
#: to the 128K float8 recipe on one H200 (2026-12-01/02: tensorwise 129.0 GiB, rowwise 136.05,
#: bf16 122.68); rowwise_with_gw_hp unmeasured, given rowwise's (an upper bound: it casts
#: less). Under "mlp" recomputation (the 32K layout) the loss, not the recomputation, is the
#: peak.
FLOAT8_RECOMPUTE_MLP = {"tensorwise": 5.7, "rowwise": 7.2, "rowwise_with_gw_hp": 7.2}
#: The same for a layer whose input comes back from host memory (``offload_activations``,
#: the frontier recipes, MLP tiled): ~10 layer inputs at once (the restored input, the
#: next one's prefetch, the recomputed layer's float32 norm work and attention's), fitted
#: to 7B on one H200 at 128K and 256K (steady steps) and 512K (its backward).
RECOMPUTE_OFFLOADED = 10.0
#: The fused loss's working memory beyond its two gradients besides the float32 sum's
#: surplus over the bf16 head gradient (256 MiB chunks; measured 1.57 GiB at 128K).
FUSED_LOSS_CHUNKS = 0.55 * GIB
#: Bytes of a weight stored as torchao's NF4 (4-bit codes, an 8-bit scaler per 64 values, the
#: scalers' own scalers): measured 0.518 at 72B's MLP shapes (BENCHMARKS.md, "A frozen NF4 base
#: linear").
NF4_BYTES = 0.518
#: The chunked loss over materialised logits: float32 chunk temporaries (512 MiB chunks).
LOGITS_LOSS_CHUNKS = 1.0 * GIB
#: What an untiled MLP with adapters holds beyond the plain one while PEFT's forward makes it
#: again (only where the MLP is not made by hand: a float8 unit's), in tokens x intermediate x
#: 2 bytes: four more intermediates (the adapters' outputs of gate and up, scaled, beside the
#: base's). Fitted to one run (7B at 128K
#: on one H200, r 16 on every linear, "except_attention", compiled: 106.84 GiB), where it was
#: counted as 1.22 layer inputs a layer before the snapshot of issue 46 placed the plain MLP's
#: recomputation; a tiled MLP's adapters are inside its tile term (the 72B QLoRA slice).
ADAPTER_RECOMPUTE_MLP = 4.0
