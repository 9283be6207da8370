"""Describe a transformers model's modules for the rule engine: modality, kind, heads.

The default tables cover Qwen2.5-VL, Qwen2-VL and text-only Qwen2/Llama: their module
names follow transformers' shared layout (``visual.blocks.N``, ``visual.merger``,
``language_model.layers.N``, ``embed_tokens``, ``lm_head``). A family passes its own.
"""

from __future__ import annotations

import fnmatch
from typing import Callable

import torch

from weft.core.recipe.rule_engine import ModuleInfo

#: (glob on the module path, modality); first match wins.
MODALITY_PATTERNS: tuple[tuple[str, str], ...] = (
    ("*visual.merger*", "projector"),
    ("*visual*", "vision"),
    ("*embed_tokens", "embedding"),
    ("lm_head", "head"),
)

#: Shard units besides the repeated blocks: (glob, why).
UNIT_PATTERNS: tuple[str, ...] = ("*visual.merger", "*embed_tokens", "lm_head")


def modality_of(path: str, *, patterns: tuple[tuple[str, str], ...] = MODALITY_PATTERNS) -> str:
    for pattern, modality in patterns:
        if fnmatch.fnmatchcase(path, pattern):
            return modality
    return "text"


def describe_modules(
    model: torch.nn.Module, *, modality_of: Callable[[str], str] = modality_of,
    unit_patterns: tuple[str, ...] = UNIT_PATTERNS,
) -> list[ModuleInfo]:
    """Root first, then attention modules, shard units and (kind ``params``) the modules
    outside every unit that hold parameters of their own (a patch embedding, a final norm:
    FSDP2 keeps them in the root's unit, the optimizer rules still see their modality), in
    module order."""
    infos = [ModuleInfo(path="", class_name=type(model).__name__, kind="root")]
    units: list[str] = []
    block_lists = {name for name, m in model.named_modules()
                   if isinstance(m, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] in ("blocks", "layers")}
    for path, module in model.named_modules():
        if not path:
            continue
        parent = path.rsplit(".", 1)[0] if "." in path else ""
        if parent in block_lists or any(fnmatch.fnmatchcase(path, p) for p in unit_patterns):
            infos.append(ModuleInfo(path=path, class_name=type(module).__name__, kind="unit",
                                    modality=modality_of(path)))
            units.append(path)
            continue
        if next(module.parameters(recurse=False), None) is not None and \
                not any(path.startswith(f"{unit}.") for unit in units):
            infos.append(ModuleInfo(path=path, class_name=type(module).__name__, kind="params",
                                    modality=modality_of(path)))
        if _is_attention(module):
            heads = int(module.num_heads if hasattr(module, "num_heads") else module.config.num_attention_heads)
            groups = int(getattr(module, "num_key_value_groups", 1) or 1)
            kv_heads = int(getattr(module, "num_key_value_heads", heads // groups))
            infos.append(ModuleInfo(path=path, class_name=type(module).__name__, kind="attention",
                                    modality=modality_of(path), heads=heads, kv_heads=kv_heads,
                                    head_dim=int(module.head_dim)))
    return infos


def _is_attention(module: torch.nn.Module) -> bool:
    name = type(module).__name__
    return name.endswith("Attention") and hasattr(module, "head_dim")

