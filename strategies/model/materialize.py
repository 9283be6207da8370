"""A meta-device model given storage a part at a time, each part finished before the next.

``to_empty`` on the whole model allocates every weight at once: for a 4-bit base that is the
bf16 model before a single weight is quantised (Qwen2.5-VL-72B: 145 GB, more than one GPU
holds). Here the listed parts (the units whose weights are quantised) are materialised,
filled and finished (quantised) one after another, so no more than one unit's
full-precision weights exist beside the finished ones; then everything else at once.
The values are those of the whole-model path: the seeded init and the safetensors load
fill each tensor by its name alone.
"""

from __future__ import annotations

import itertools
from typing import Callable, Sequence

import torch


def materialize_in_parts(model: torch.nn.Module, *, device: torch.device, parts: Sequence[str],
                         fill: Callable[[Callable[[str], bool]], int],
                         finish: Callable[[str, torch.nn.Module], None]) -> int:
    """``fill(include)`` fills the parameters whose names ``include`` accepts; ``finish(path,
    module)`` runs on each part once it is filled. Returns how many tensors were filled."""
    filled = 0
    for path in parts:
        module = model.get_submodule(path)
        module.to_empty(device=device)
        filled += fill(lambda name, prefix=path + ".": name.startswith(prefix))
        finish(path, module)
    done = tuple(path + "." for path in parts)
    for _, module in model.named_modules():
        own = itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False))
        if any(t.is_meta for t in own):
            module.to_empty(device=device, recurse=False)
    filled += fill(lambda name: not name.startswith(done))
    return filled
