"""Before launching: a step's per-rank seconds by part, by arithmetic (``weft plan --estimate``).

The matrix products at the GPU kind's measured rate (float8 units at their scaling's), causal
attention's forward and backward at the attention kernels' rates, an element-wise overhead per
token and layer, and the communication that does not overlap compute; the units, shape and
mesh as the memory model takes them (core/plan/estimate.py). Plain arithmetic, no torch.
"""

from __future__ import annotations

from weft.core.plan.estimate import (
    Contribution,
    Setup,
    Shape,
    Unit,
    add_parts,
    backward_reaches,
    mlp_by_hand,
    offload_kept,
)
from weft.core.plan.flops import sequence_flops
from weft.core.plan.gpus import GpuKind


def step_seconds(units: list[Unit], shape: Shape, setup: Setup, gpu: GpuKind, *,
                 extra: tuple[Contribution, ...] = ()) -> dict[str, float]:
    """Per-rank seconds of one step, by part: matrix products (recomputation included),
    attention forward and backward, element-wise overhead, exposed communication; ``extra``:
    the root's strategies' own parts."""
    tokens = setup.tokens / setup.sp
    text = [u for u in units if u.modality == "text"]
    root = next((u for u in units if u.modality is None), None)
    head = shape.vocab * shape.hidden  # 6 FLOPs per weight and token, a frozen one's 4 (no weight gradient)
    mlp = 3 * shape.hidden * shape.intermediate  # gate, up, down

    def redone(u: Unit) -> float:  # a decoder unit's recomputed matmul FLOPs
        whole = u.checkpoint in ("full", "except_attention")
        tiled = u.mlp_tile_tokens > 0
        if not (whole or tiled or u.checkpoint == "mlp"):
            return 0.0
        # What the MLP's recomputation makes again: gate and up by hand or eagerly (torch's
        # checkpoint stops before the down product), all three through a compiled module's forward
        # or a tile's own forward (strategies/memory/swiglu.py).
        again = 2 * shape.hidden * shape.intermediate if mlp_by_hand(u) or not (u.compiled or tiled) else mlp
        return 2 * tokens * ((shape.layer_params + u.adapter_params - mlp) * whole + again)

    again_flops = [redone(u) for u in text]
    # Each decoder unit's products at its own rate: float8 by rule at its scaling's measured speed-up.
    dense = sum((tokens * _per_token(u, shape.layer_params) + r) / gpu.float8_speedup(u.float8)
                for u, r in zip(text, again_flops))
    dense += tokens * (_per_token(root, head) if root is not None else 6 * head)
    recompute = sum(again_flops)
    towers = [u for u in units if u.modality == "vision"]
    vision = (sum(_per_token(u, u.params) for u in towers) if backward_reaches(towers)
              else 2 * shape.vision_params) * setup.patches / setup.sp if shape.vision_blocks else 0.0
    # Causal attention over each of the micro-batch's rows, this rank's share: 2 S^2 h forward per layer.
    attn = 2 * setup.tokens**2 * shape.heads * shape.head_dim / setup.sp / setup.rows
    again = sum(1 for u in text if u.checkpoint in ("full", "attention"))
    # Thinned offload: each regenerated input is one more forward of the unit before, no gradients.
    regenerated = sum(1 for u in text if u.offload_activations) - len(offload_kept(units))
    dense += regenerated * 2 * tokens * shape.layer_params
    again += regenerated
    part = {
        "matmul": (dense + vision) / (gpu.matmul_tflops * 1e12),
        "attention forward": attn * (len(text) + again) / (gpu.attention_fwd_tflops * 1e12),
        "attention backward": 2.5 * attn * len(text) / (gpu.attention_bwd_rate(setup.tokens / setup.rows) * 1e12),
        "element-wise": gpu.overhead_s * tokens * (len(text) * (1.3 if recompute else 1.0) + regenerated / 3),
        "communication": _exposed_comm(units, shape, setup, gpu, tokens),
    }
    for c in extra:
        add_parts(part, c.seconds(units=units, shape=shape, setup=setup, gpu=gpu) if c.seconds is not None else {})
    part["total"] = sum(part.values())
    part["tokens_per_s"] = setup.tokens * setup.dp_shard * setup.dp_replicate / part["total"]
    # MFU as the reports and benchmarks count it (core/plan/flops.py), this rank's share of the sequence.
    # A frozen weight counts the 4 FLOPs it runs, not 6; adapters are trained weights.
    mine = [*text, *([root] if root is not None else [])]
    useful = sequence_flops(params=len(text) * shape.layer_params + head + sum(u.adapter_params for u in mine),
                            frozen=sum(shape.layer_params if u is not root else head for u in mine if not u.trainable),
                            layers=len(text), hidden=shape.heads * shape.head_dim, length=setup.tokens) / setup.sp
    part["mfu"] = useful / part["total"] / (gpu.peak_tflops * 1e12)
    return part


def forward_seconds(units: list[Unit], shape: Shape, setup: Setup, gpu: GpuKind) -> float:
    """Per-rank seconds of one more forward of the whole model without gradients (a reference
    model's pass, say): its products (2 FLOPs a weight and token), causal attention's forward, a
    third of the element-wise work (what a forward alone runs of it)."""
    tokens = setup.tokens / setup.sp  # this rank's share
    layers = sum(1 for u in units if u.modality == "text")
    products = 2 * tokens * layers * shape.layer_params + 2 * shape.vision_params * setup.patches / setup.sp
    attention = 2 * setup.tokens**2 * shape.heads * shape.head_dim / setup.sp / setup.rows * layers
    return (products / (gpu.matmul_tflops * 1e12) + attention / (gpu.attention_fwd_tflops * 1e12)
            + gpu.overhead_s * tokens * layers / 3)


def _per_token(u: Unit, base: float) -> float:  # matmul FLOPs per token, its adapters' too
    return (6 if u.trainable else 4) * base + 6 * u.adapter_params


def _exposed_comm(units, shape: Shape, setup: Setup, gpu: GpuKind, tokens: float) -> float:
    """Ulysses' all-to-alls are on the critical path (4 per layer forward, 4 backward); the
    ring's transfers and FSDP2's collectives overlap compute except one unit's worth."""
    bw = gpu.link_gbps * 1e9
    layers = sum(1 for u in units if u.modality == "text")
    ulysses = 0.0
    if setup.ulysses > 1:
        width = shape.hidden * 2 + 2 * shape.kv_heads * shape.head_dim  # q and out, k and v
        per = tokens * width * 2 * (setup.ulysses - 1) / setup.ulysses
        ulysses = 2 * layers * per / bw
    # Gathered units over more than one rank: the first gather, the last reduce-scatter are not hidden.
    largest = max((u.params for u in units if u.gathers and u.modality and setup.ranks(u.shard_dims) > 1), default=0)
    fsdp = 3 * largest * 2 / bw
    return ulysses + fsdp
