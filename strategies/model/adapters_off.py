"""The model without its adapters, for a moment: the reference model of LoRA preference training.

With LoRA the base is frozen, so the base *is* the model the training started from (adapters
start at zero): a forward with every adapter switched off gives the reference model's
log-probabilities without a second copy of the weights (TRL does the same with PEFT models).
PEFT's own switch (``BaseTunerLayer.enable_adapters``) is used; switching back also turns the
adapters' ``requires_grad`` on, so each parameter's flag is put back as it was.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def adapter_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every PEFT adapter layer (LoRA, DoRA) in ``model``."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module) -> Iterator[int]:
    """Inside, ``model`` computes as its base (every adapter layer off); yields how many
    layers were switched. Raises ValueError where the model has no adapter layer."""
    layers = adapter_layers(model)
    if not layers:
        raise ValueError("the model has no adapter layer to switch off")
    flags = [(p, p.requires_grad) for layer in layers for p in layer.parameters()]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield len(layers)
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for p, flag in flags:
            p.requires_grad_(flag)
