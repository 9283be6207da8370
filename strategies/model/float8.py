"""Linear layers that multiply in float8: torchao's float8 training, by module swap.

``Float8Linear`` (a subclass of ``nn.Linear``: names and parameters unchanged) casts its
input, weight and output gradient to float8 with dynamic scales before each of its three
products and keeps its weight in the storage dtype; the matrix units of Hopper, Ada and
Blackwell GPUs run float8 at twice bf16's rate. Scaling recipes (torchao's names):
``tensorwise`` (one scale per tensor: fastest, coarsest), ``rowwise`` (a scale per row) and
``rowwise_with_gw_hp`` (rowwise, the weight gradient's product left in high precision: its
inputs would need casting along the token axis, a transposed pass per product).

Left in their dtype: layers whose dimensions are not multiples of 16 (float8 GEMMs need
them), adapters' layers (``lora_``: r-wide, nothing to gain), and anything the caller's unit
does not hold (the output head is the root's).
"""

from __future__ import annotations

import torch

from weft.strategies.model.float8_scalings import RECIPES

#: The lowest compute capability with float8 matrix units (Ada: 8.9; Hopper 9.0; Blackwell 10.x).
MIN_CAPABILITY = (8, 9)


def eligible(module: torch.nn.Module, fqn: str) -> bool:
    """Whether a module under a float8 unit is converted (see the module docstring)."""
    return (isinstance(module, torch.nn.Linear) and "lora_" not in fqn
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def has_float8_units(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


def convert(module: torch.nn.Module, *, recipe: str, emulate: bool = False) -> list[str]:
    """The eligible linear layers under ``module`` swapped for torchao's ``Float8Linear`` with
    ``recipe``'s scaling, in place (before compile and FSDP2, torchao's order). ``emulate``: the
    float8 casts with high-precision products (torchao's emulation: the numerics anywhere, no
    float8 matrix units needed). Returns the converted layers' names, relative to ``module``."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown float8 recipe {recipe!r}; accepted: {', '.join(RECIPES)}")
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    converted: list[str] = []

    def take(layer: torch.nn.Module, fqn: str) -> bool:
        if eligible(layer, fqn):
            converted.append(fqn)
            return True
        return False

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
    convert_to_float8_training(module, config=config, module_filter_fn=take)
    return converted
