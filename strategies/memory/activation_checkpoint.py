"""Activation checkpointing per module: keep a unit's inputs, recompute its inside in backward.

Uses torch's composable ``checkpoint`` (module hooks, no wrapper class), so module
and parameter names stay what transformers and checkpoints expect, and FSDP2's
``fully_shard`` composes with it. Apply before sharding (torch's documented order:
activation checkpointing, then compile, then FSDP).

``except_attention`` is per-operator (torch's selective checkpointing): the whole unit is
recomputed but for its attention kernel, whose out and LSE are kept from the forward. At
long lengths attention is the costliest thing a recomputation repeats (O(L^2)) and its
outputs the cheapest to keep (O(L), one hidden-sized tensor per layer).
"""

from __future__ import annotations

import functools

import torch
from torch.distributed._composable import checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

MODES: tuple[str, ...] = ("off", "full", "attention", "mlp", "except_attention")


@functools.cache
def attention_ops() -> frozenset:
    """The attention kernels' operators whose outputs ``except_attention`` keeps: weft's
    flash-attn-4 operator and torch's fused SDPA kernels (cuDNN, flash, efficient, CPU)."""
    from weft.strategies.attention.kernels import flash_ops

    aten = torch.ops.aten
    return frozenset({
        flash_ops.fa4_forward._opoverload,
        aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
    })


def _keep_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in attention_ops() else CheckpointPolicy.PREFER_RECOMPUTE

#: Child names the selective modes look for, across Qwen2/Qwen2.5-VL/Llama blocks.
_CHILDREN = {"attention": ("self_attn", "attn"), "mlp": ("mlp",)}


def apply_checkpointing(module: torch.nn.Module, *, mode: str) -> int:
    """``full``: the whole unit; ``attention``/``mlp``: only that child (selective);
    ``except_attention``: the whole unit but its attention kernel's outputs.

    Returns how many modules were checkpointed (0 for ``off`` or no such child).
    """
    if mode not in MODES:
        raise ValueError(f"unknown activation checkpointing mode {mode!r}; accepted: {', '.join(MODES)}")
    if mode == "off":
        return 0
    if mode == "full":
        checkpoint(module)
        return 1
    if mode == "except_attention":
        checkpoint(module, context_fn=functools.partial(create_selective_checkpoint_contexts, _keep_attention))
        return 1
    count = 0
    for name, child in module.named_children():
        if name in _CHILDREN[mode]:
            checkpoint(child)
            count += 1
    return count
