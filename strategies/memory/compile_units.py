"""torch.compile inside a unit: every child, the attention only when asked, in place.

``nn.Module.compile`` compiles a module's call where it stands, so parameter and
module names stay what transformers and checkpoints expect (no ``_orig_mod``).
What compiling buys is fusion of the memory-bound element-wise work (RMSNorm's
float32 passes, SwiGLU's activation and product, the rotary embedding in float32
and the casts around the attention kernel) into single kernels, in the forward, its
recomputation and the backward. The attention child is compiled only when the caller
knows its function traces whole: one kernel that is a torch operator (flash-attn-4
through ``flash_ops``, torch's SDPA), no collectives (ring, Ulysses), which dynamo
would only break around. Order: activation checkpointing, then compile, then FSDP
(torch's documented order).
"""

from __future__ import annotations

import torch

#: Children that run attention (Qwen2/Qwen2.5-VL/Llama text blocks, vision blocks).
ATTENTION_CHILDREN: tuple[str, ...] = ("self_attn", "attn")


def compile_unit(module: torch.nn.Module, *, backend: str = "inductor", attention: bool = False,
                 skip: tuple[str, ...] = (), whole: bool = False) -> int:
    """Compile each child of ``module`` (its attention child only with ``attention``; none named
    in ``skip``, e.g. a tiled MLP, whose hooks run the module tile by tile); a unit without
    children is compiled whole, and so is one asked ``whole`` (one graph: what lies between
    the children, the residual adds, fuses with them; the caller asks it only of a unit with
    no hooks around its forward, recomputation's or FSDP's). Returns how many modules were
    compiled."""
    if whole:
        module.compile(backend=backend)
        return 1
    children = [child for name, child in module.named_children()
                if (attention or name not in ATTENTION_CHILDREN) and name not in skip]
    if not any(True for _ in module.named_children()):
        children = [module]
    for child in children:
        child.compile(backend=backend)
    return len(children)
