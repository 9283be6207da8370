"""Activation checkpointing per module: keep a unit's inputs, recompute its inside in backward.

Uses torch's composable ``checkpoint`` (module hooks, no wrapper class), so module
and parameter names stay what transformers and checkpoints expect, and FSDP2's
``fully_shard`` composes with it. Apply before sharding (torch's documented order:
activation checkpointing, then compile, then FSDP).
"""

from __future__ import annotations

import torch
from torch.distributed._composable import checkpoint

MODES: tuple[str, ...] = ("off", "full", "attention", "mlp")

#: Child names the selective modes look for, across Qwen2/Qwen2.5-VL/Llama blocks.
_CHILDREN = {"attention": ("self_attn", "attn"), "mlp": ("mlp",)}


def apply_checkpointing(module: torch.nn.Module, *, mode: str) -> int:
    """``full``: the whole unit; ``attention``/``mlp``: only that child (selective).

    Returns how many modules were checkpointed (0 for ``off`` or no such child).
    """
    if mode not in MODES:
        raise ValueError(f"unknown activation checkpointing mode {mode!r}; accepted: {', '.join(MODES)}")
    if mode == "off":
        return 0
    if mode == "full":
        checkpoint(module)
        return 1
    count = 0
    for name, child in module.named_children():
        if name in _CHILDREN[mode]:
            checkpoint(child)
            count += 1
    return count
