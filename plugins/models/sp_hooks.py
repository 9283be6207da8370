"""Module hooks that split a model's sequence over the SP ranks, after the vision merge.

- a forward pre-hook on the text decoder (the module holding ``embed_tokens`` and
  ``layers``) cuts its inputs to this rank's part: for Qwen2.5-VL that is after
  the model scattered image embeddings into the sequence and computed the 3-D
  mRoPE position ids on the whole sequence;
- a forward pre-hook on the vision tower keeps only this rank's images, and a
  forward hook puts every image's merged embeddings back together, so the model's
  own scatter sees the output of the whole tower;
- when an image reaches the rule's ``min_patches`` (vision strategy
  ``vision_ulysses``), the ranks share the tower instead: a pre-hook on each vision
  block cuts the patch sequence (and its rotary tables) to this rank's part, the
  vision attention runs Ulysses over the parts, and a hook on the last block puts
  the patches back together before the patch merger.

Only ``register_forward_pre_hook`` / ``register_forward_hook``: no transformers
code is replaced.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from weft.strategies.attention.vision_ulysses import part_sizes
from weft.strategies.sequence.model_split import TextSplit, assign_images, gather_rows


def text_decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose children are ``embed_tokens`` and ``layers`` (the decoder stack)."""
    for _, module in model.named_modules():
        children = dict(module.named_children())
        if "embed_tokens" in children and "layers" in children:
            return module
    raise ValueError(f"{type(model).__name__} has no text decoder (a module with embed_tokens and layers)")


def vision_tower(model: torch.nn.Module, *, modality_of: Callable[[str], str]) -> torch.nn.Module | None:
    """The outermost module of the vision modality that merges patches: the tower, known by
    the family's declared modality (``modality_of``, as the plan knows it), not by its name."""
    for name, module in model.named_modules():
        if name and modality_of(name) == "vision" and hasattr(module, "spatial_merge_size"):
            return module
    return None


class SequenceParallelHooks:
    """Installs and owns the hooks of one model; ``remove()`` takes them off."""

    def __init__(self, *, model: torch.nn.Module, split: TextSplit, text: torch.nn.Module,
                 visual: torch.nn.Module | None, sp_group: Any, sp_rank: int, sp_world: int,
                 share_threshold: int | None = None) -> None:
        self.split = split
        self.sp_group, self.sp_rank, self.sp_world = sp_group, sp_rank, sp_world
        self.share_threshold = share_threshold
        self._pending: list[dict] = []  # vision calls between pre-hook and hook
        self._shared: list[int] | None = None  # patch rows per rank while the ranks share the tower
        self.handles = [text.register_forward_pre_hook(self._split_text, with_kwargs=True)]
        if visual is not None and sp_world > 1:
            self.merge = visual.spatial_merge_size
            self.handles.append(visual.register_forward_pre_hook(self._local_images, with_kwargs=True))
            self.handles.append(visual.register_forward_hook(self._gather_images, with_kwargs=True))
            if share_threshold is not None:
                for block in visual.blocks:
                    self.handles.append(block.register_forward_pre_hook(self._block_part, with_kwargs=True))
                self.handles.append(visual.blocks[-1].register_forward_hook(self._block_gather))

    @property
    def multiple(self) -> int:
        """Sequence lengths must be a multiple of this (the core pads to it)."""
        return self.split.multiple

    def shard(self, x: torch.Tensor, *, dim: int) -> torch.Tensor:
        return self.split.shard(x, dim=dim)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    # -- text ------------------------------------------------------------------

    def _split_text(self, module, args, kwargs):
        if args:
            raise ValueError(f"{type(module).__name__} was called with positional inputs; "
                             "weft's sequence split needs keywords")
        return args, self.split.split_decoder_inputs(kwargs)

    # -- vision ----------------------------------------------------------------

    def _local_images(self, module, args, kwargs):
        pixels = args[0] if args else kwargs.pop("hidden_states")
        grid = kwargs["grid_thw"] if "grid_thw" in kwargs else args[1]
        patches = grid.prod(-1).tolist()  # patch rows of each image in `pixels`
        if self.share_threshold is not None and max(patches) >= self.share_threshold:
            # A large image: every rank runs the tower on all images, each on its part of the patches.
            self._shared = part_sizes(sum(patches), self.sp_world)
            self._pending.append({"shared": True})
            return (pixels, *args[1:]), kwargs
        owned = assign_images(patches, self.sp_world)
        starts = [0]
        for n in patches:
            starts.append(starts[-1] + n)
        mine = owned[self.sp_rank]
        if mine:
            local_pixels = torch.cat([pixels[starts[i] : starts[i + 1]] for i in mine])
            local_grid = grid[mine]
        else:
            # Fewer images than ranks: run the tower on a dummy image anyway, so every
            # rank takes part in the tower's FSDP collectives, forward and backward.
            local_grid = torch.tensor([[1, self.merge, self.merge]], dtype=grid.dtype, device=grid.device)
            local_pixels = pixels.new_zeros((self.merge * self.merge, pixels.shape[1]))
        self._pending.append({"owned": owned, "tokens": [n // self.merge**2 for n in patches], "dummy": not mine})
        kwargs = dict(kwargs, grid_thw=local_grid)
        return (local_pixels, *args[2:]), kwargs

    def _gather_images(self, module, args, kwargs, output):
        call = self._pending.pop()
        if call.get("shared"):
            self._shared = None  # the last block already gathered the patches
            return output
        merged = output.pooler_output if hasattr(output, "pooler_output") else output  # (N_local, H)
        full = self._gather_merged(merged, call=call)
        if hasattr(output, "pooler_output"):
            output.pooler_output = full
            return output
        return full

    def _gather_merged(self, merged: torch.Tensor, *, call: dict) -> torch.Tensor:
        """(N_local, H) rows of this rank's images -> (N, H) rows of every image, in image order.

        One tensor of the tower's output per call; a subclass whose tower returns more
        per-token features (Qwen3-VL's DeepStack) gathers each of them with it."""
        owned, tokens = call["owned"], call["tokens"]
        sizes = [sum(tokens[i] for i in images) for images in owned]
        local = merged[:0] if call["dummy"] else merged
        gathered = gather_rows(local, sizes=sizes, group=self.sp_group)  # rank order
        # Back to the images' own order, which the model's scatter expects.
        offsets, position = {}, 0
        for images in owned:
            for i in images:
                offsets[i] = position
                position += tokens[i]
        full = torch.cat([gathered[offsets[i] : offsets[i] + tokens[i]] for i in range(len(tokens))])
        if call["dummy"]:
            full = full + 0.0 * merged.sum()  # keeps the dummy's backward (FSDP) in the graph
        return full

    # -- vision, shared by the ranks (large images) ------------------------------

    def _block_part(self, module, args, kwargs):
        if self._shared is None:
            return None
        sizes = self._shared
        start = sum(sizes[: self.sp_rank])
        end = start + sizes[self.sp_rank]
        hidden = args[0] if args else kwargs["hidden_states"]
        if hidden.shape[0] == sum(sizes):  # the first block gets the whole sequence
            hidden = hidden[start:end]
        if args:
            args = (hidden, *args[1:])
        else:
            kwargs = dict(kwargs, hidden_states=hidden)
        for key in ("position_embeddings", "rotary_pos_emb"):
            value = kwargs.get(key)
            if isinstance(value, tuple) and value[0].shape[0] == sum(sizes):
                kwargs = dict(kwargs, **{key: tuple(t[start:end] for t in value)})
            elif isinstance(value, torch.Tensor) and value.shape[0] == sum(sizes):
                kwargs = dict(kwargs, **{key: value[start:end]})
        return args, kwargs

    def _block_gather(self, module, args, output):
        if self._shared is None:
            return None
        return gather_rows(output, sizes=self._shared, group=self.sp_group)  # (S, hidden) for the merger
