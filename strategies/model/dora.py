"""DoRA's magnitudes drawn where weft draws weights: after the base's weights are in place.

PEFT's DoRA layer multiplies the direction of ``W + s B @ A`` (each output row over its norm)
by a trained magnitude per output row, and sets the magnitudes to those norms when it wraps
the layer, so that the adapted model starts as the base. weft wraps the layers on the meta
device, before any weight exists (strategies/model/materialize.py fills them later), so the
magnitudes are drawn here instead, from the layer's base weight and adapters as they are now:
4-bit bases in their dequantised values (the ones every product uses), each rank its own rows
under FSDP2 (the weight and the magnitudes are split by output rows alike; A, r rows, is
gathered whole). The same values on any sharding, as `weft check`'s reference needs.
"""

from __future__ import annotations

import torch


def init_magnitudes(model: torch.nn.Module) -> int:
    """Every DoRA layer's magnitudes := the row norms of ``W + scaling B @ A`` (float32, stored in
    the magnitudes' dtype). Returns how many layers were drawn."""
    from peft.tuners.lora import LoraLayer

    count = 0
    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        for name, magnitude in module.lora_magnitude_vector.items():
            weight = _local(module.get_base_layer().weight).float()  # (out_local, in)
            a = _whole(module.lora_A[name].weight).float()  # (r, in)
            b = _local(module.lora_B[name].weight).float()  # (out_local, r)
            norms = (weight + module.scaling[name] * (b @ a)).norm(p=2, dim=1)  # (out_local,)
            target = _local(magnitude.weight)
            with torch.no_grad():
                target.copy_(norms.to(target.dtype))
            count += 1
    return count


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's rows: a DTensor's local shard, a 4-bit weight dequantised, else itself."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    dequantize = getattr(tensor, "get_original_weight", None)  # torchao's NF4 tensor
    return dequantize() if dequantize is not None else tensor


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
