"""torch.compile inside a unit: every child except its attention, in place.

``nn.Module.compile`` compiles a module's call where it stands, so parameter and
module names stay what transformers and checkpoints expect (no ``_orig_mod``).
The attention child is left eager: weft's attention functions are autograd
Functions around external kernels (flash-attn-4, cuDNN) and collectives, which
dynamo would only break around. What compiling buys is fusion of the memory-bound
element-wise work (RMSNorm's float32 passes, SwiGLU's activation and product)
into single kernels, in the forward, its recomputation and the backward. Order:
activation checkpointing, then compile, then FSDP (torch's documented order).
"""

from __future__ import annotations

import torch

#: Children that run attention (Qwen2/Qwen2.5-VL/Llama text blocks, vision blocks).
ATTENTION_CHILDREN: tuple[str, ...] = ("self_attn", "attn")


def compile_unit(module: torch.nn.Module, *, backend: str = "inductor") -> int:
    """Compile each child of ``module`` that is not its attention; a unit without
    children is compiled whole. Returns how many modules were compiled."""
    children = [child for name, child in module.named_children() if name not in ATTENTION_CHILDREN]
    if not any(True for _ in module.named_children()):
        children = [module]
    for child in children:
        child.compile(backend=backend)
    return len(children)
