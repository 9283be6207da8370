"""Qwen3-VL: DeepStack ViT features added to the first decoder layers, interleaved mRoPE.

What differs from Qwen2.5-VL, read from transformers' ``modeling_qwen3_vl.py``:

- the vision tower (``model.visual``) returns the merged embeddings (``pooler_output``,
  one row per image token) and ``deepstack_features``: one tensor of the same rows
  per tapped ViT block (``deepstack_visual_indexes``), each through its own merger in
  ``visual.deepstack_merger_list``;
- the text decoder (``model.language_model``) is called with keywords only:
  ``inputs_embeds`` (B, S, H), ``attention_mask`` (B, S), ``position_ids`` (3, B, S)
  from the model's rope index on the whole sequence, ``visual_pos_masks`` (B, S) and
  ``deepstack_visual_embeds`` (a list, one (N_visual, H) tensor per tapped block,
  rows in row-major (B, S) order of the visual positions); after decoder layer i it
  adds ``deepstack_visual_embeds[i]`` to the hidden states at ``visual_pos_masks``;
- the rope index (``Qwen3VLModel.get_rope_index``) needs ``mm_token_type_ids``, which
  weft's samples carry; ``document_positions`` passes it.

Under sequence parallelism the hooks cut ``visual_pos_masks`` like the sequence and
keep the DeepStack rows of this rank's visual positions, in its local order
(``weft.strategies.sequence.deepstack``). With images spread over the SP ranks, every DeepStack
feature is gathered back with the merged embeddings. The ranks may share the tower
(``vision_ulysses``, large images): the blocks DeepStack taps then gather their patches
before the tap's merger (its 2x2 merge needs whole groups of patches), and the next
block cuts them again.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from weft.plugins.models import build
from weft.plugins.models.base import TransformersFamily
from weft.plugins.models.sp_hooks import SequenceParallelHooks
from weft.plugins.models.vision_sync import VisionKeepAlive
from weft.strategies.sequence.deepstack import local_rows, select_rows
from weft.strategies.sequence.model_split import gather_rows

#: (glob, modality), first match wins: the DeepStack mergers project like the merger.
MODALITY_PATTERNS: tuple[tuple[str, str], ...] = (
    ("*visual.merger*", "projector"),
    ("*visual.deepstack_merger_list*", "projector"),
    ("*visual*", "vision"),
    ("*embed_tokens", "embedding"),
    ("lm_head", "head"),
)

#: Each DeepStack merger is a unit of its own (fnmatch's ``*`` would also take their children).
UNIT_PATTERNS: tuple[str, ...] = (
    "*visual.merger", "*visual.deepstack_merger_list.[0-9]", "*visual.deepstack_merger_list.[0-9][0-9]",
    "*embed_tokens", "lm_head",
)

#: Keyword inputs of the tower that describe the whole call's images: precomputed by
#: the caller, they would not match the images a rank keeps.
_WHOLE_CALL_KWARGS = ("position_ids", "cu_seqlens", "max_seqlen", "interp_indices", "interp_weights")


class DeepStackHooks(SequenceParallelHooks):
    """``SequenceParallelHooks`` that also cut DeepStack's decoder inputs and gather its features."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        visual = kwargs["visual"]
        if visual is not None and self.sp_world > 1 and self.share_threshold is not None:
            for index in visual.deepstack_visual_indexes:
                self.handles.append(visual.blocks[index].register_forward_hook(self._tap_gather))

    # -- text ------------------------------------------------------------------

    def _split_text(self, module, args, kwargs):
        mask = kwargs.get("visual_pos_masks")  # (B, S), the whole sequence's
        features = kwargs.get("deepstack_visual_embeds")  # [(N_visual, H)] per tapped block
        args, out = super()._split_text(module, args, kwargs)
        if mask is not None:
            out["visual_pos_masks"] = self.split.shard(mask, dim=1)  # (B, S_local)
            if features is not None:
                rows = local_rows(mask, shard=self.split.shard)  # (N_local,)
                out["deepstack_visual_embeds"] = select_rows(list(features), rows)  # [(N_local, H)]
        return args, out

    # -- vision, images spread over the ranks ------------------------------------

    def _local_images(self, module, args, kwargs):
        given = [key for key in _WHOLE_CALL_KWARGS if kwargs.get(key) is not None]
        if given:
            raise ValueError(f"{type(module).__name__} was given precomputed {given}; weft's image split "
                             "recomputes them per rank, so leave them out")
        return super()._local_images(module, args, kwargs)

    def _gather_images(self, module, args, kwargs, output):
        call = self._pending[-1]  # the base hook pops it
        features = getattr(output, "deepstack_features", None)
        if not call.get("shared") and features:
            # Same rows as the merged embeddings (one per image token), so the same gather.
            output.deepstack_features = [self._gather_merged(f, call=call) for f in features]
        return super()._gather_images(module, args, kwargs, output)

    # -- vision, shared by the ranks (large images) ------------------------------

    def _tap_gather(self, module, args, output):
        """A tapped block's output back to the whole patch sequence for its DeepStack merger;
        the next block's pre-hook cuts it to this rank's part again."""
        if self._shared is None or output.shape[0] == sum(self._shared):  # spread images, or the last block
            return None
        return gather_rows(output, sizes=self._shared, group=self.sp_group)  # (S_patches, hidden)


class DeepStackKeepAlive(VisionKeepAlive):
    """``VisionKeepAlive`` whose blank image also runs the DeepStack mergers' backward: each
    is an FSDP unit whose gradient reduction every rank must join."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._blank = False
        self.handles.append(self.visual.register_forward_hook(self._fold))

    def _blank_image(self, module, args, output):
        self._blank = bool(self._blank_calls)
        try:
            return super()._blank_image(module, args, output)
        finally:
            self._blank = False

    def _fold(self, module, args, output):
        features = getattr(output, "deepstack_features", None)
        if not self._blank or not features:
            return None
        output.pooler_output = output.pooler_output + 0.0 * sum(f.sum() for f in features)  # adds nothing
        return output


@attrs.frozen(kw_only=True)
class Qwen3VLFamily(TransformersFamily):
    """Qwen3-VL (``Qwen3VLForConditionalGeneration``); see the module docstring."""

    name: str = "qwen3_vl"
    model_types: tuple[str, ...] = ("qwen3_vl",)
    summary: str = "Qwen3-VL: ViT with DeepStack taps into the first decoder layers, 2x2 merger, interleaved mRoPE"
    auto_class: str = "AutoModelForImageTextToText"
    modality_patterns: tuple[tuple[str, str], ...] = MODALITY_PATTERNS
    unit_patterns: tuple[str, ...] = UNIT_PATTERNS

    def sequence_parallel(self, model: torch.nn.Module, *, plan: Any, mesh: Any) -> Any:
        return DeepStackHooks(model=model, split=build.text_split(plan=plan, mesh=mesh), text=self.text_decoder(model),
                              visual=self.vision_tower(model), sp_group=mesh.sp.get_group(),
                              sp_rank=mesh.sp.get_local_rank(), sp_world=plan.mesh.sp,
                              share_threshold=plan.vision_share_threshold())

    def keep_vision_alive(self, model: torch.nn.Module) -> Any:
        return DeepStackKeepAlive(visual=self.vision_tower(model), embed=self.text_decoder(model).embed_tokens,
                                  model=model)


QWEN3_VL = Qwen3VLFamily()
