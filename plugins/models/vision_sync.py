"""Keep every rank's vision tower in step when only some data-parallel ranks have images.

FSDP2 gathers a unit's parameters in its forward and reduces its gradients in its
backward, on every rank together and in the same order. A micro-batch without images
skips the vision tower, so its rank would call the next unit's collectives while the
others are still in the tower's: a crash or a hang. When the core learns (from the
step's one count all-reduce) that some rank of the round has images and this one has
none, it marks the micro-batch (``weft.core.models.VISION_FLAG``). A forward pre-hook
on the model takes the mark; a forward hook on the text embedding, which the model
runs just before its vision tower, runs the tower on one blank image and adds its
output to the embeddings with weight zero. The model calls the tower once for its images
and once for its videos: the mark's length is the number of calls this rank lacks (with
images only, in a round where another rank has videos too, one blank call), so every
rank calls the tower equally often. The tower then runs where it runs on the
other ranks, forward and backward, and nothing changes numerically.
"""

from __future__ import annotations

import torch

from weft.core.models import VISION_FLAG as FLAG


class VisionKeepAlive:
    """``visual``: the tower; ``embed``: the text embedding the model runs just before it."""

    def __init__(self, *, visual: torch.nn.Module, embed: torch.nn.Module, model: torch.nn.Module) -> None:
        self.visual = visual
        self._blank_calls = 0
        self.handles = [
            model.register_forward_pre_hook(self._take_flag, with_kwargs=True),
            embed.register_forward_hook(self._blank_image),
        ]

    def _take_flag(self, module, args, kwargs):
        needs = kwargs.pop(FLAG, None)
        # The mark's shape, not its value, says how many calls: no device sync.
        self._blank_calls = needs.numel() if isinstance(needs, torch.Tensor) else int(bool(needs))
        return args, kwargs

    def _blank_image(self, module, args, output):
        if not self._blank_calls:
            return None
        calls, self._blank_calls = self._blank_calls, 0
        config = self.visual.config
        merge = self.visual.spatial_merge_size
        width = config.in_channels * config.temporal_patch_size * config.patch_size**2
        pixels = torch.zeros(merge * merge, width, device=output.device)  # merge x merge patches: one merged token
        grid = torch.tensor([[1, merge, merge]], device=output.device)
        for _ in range(calls):
            merged = self.visual(pixels, grid_thw=grid)
            merged = merged.pooler_output if hasattr(merged, "pooler_output") else merged
            output = output + 0.0 * merged.sum().to(output.dtype)  # joins the graph, adds nothing
        return output
