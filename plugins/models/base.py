"""``TransformersFamily``: the model-family contract for models that follow transformers'
shared layout (``visual.blocks.N``, ``visual.merger``, ``language_model.layers.N``,
``embed_tokens``, ``lm_head``). Built-in families are instances or small subclasses;
a third-party family subclasses it and overrides what differs (docs/architecture.md).
"""

from __future__ import annotations

import pathlib
from typing import Any, Callable, Sequence

import attrs
import torch

from weft.core.recipe import Recipe
from weft.core.recipe.rule_engine import ModuleInfo
from weft.plugins.models import build, inventory


@attrs.frozen(kw_only=True)
class TransformersFamily:
    """One model family; see :class:`weft.core.models.ModelFamily` for the contract."""

    name: str
    model_types: tuple[str, ...]
    summary: str = ""
    #: transformers auto class that builds and loads the model.
    auto_class: str = "AutoModelForCausalLM"
    #: (glob on the module path, modality), first match wins; unmatched paths are "text".
    modality_patterns: tuple[tuple[str, str], ...] = inventory.MODALITY_PATTERNS
    #: Shard units besides the children of ``blocks`` / ``layers`` lists.
    unit_patterns: tuple[str, ...] = inventory.UNIT_PATTERNS
    #: Whether the vision tower may be shared by the SP ranks (Ulysses over one image's
    #: patches, strategy ``vision_ulysses``): the tower's blocks must only pass the patch
    #: sequence from one block to the next.
    shares_vision: bool = True
    #: Sibling linears that the family's forward calls in this order on one input (names of a
    #: module's children), fused for inference by ``fuse_projections``; () for none.
    fused_siblings: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

    # -- building ------------------------------------------------------------

    def config(self, recipe: Recipe) -> tuple[Any, str | None]:
        return build.model_config(recipe)

    def build(self, recipe: Recipe, *, device: torch.device | str, seed: int,
              quantize: dict[str, str] | None = None) -> torch.nn.Module:
        config = self.config(recipe)[0]
        if recipe.model.path is not None and str(device) != "meta":
            model = build.from_pretrained(recipe, auto_class=self.auto_class, config=config, device=device)
            build.quantize_units(model, quantize or {})
            return model
        model = build.on_meta(auto_class=self.auto_class, config=config)
        if str(device) != "meta":
            self.materialize(model, recipe, device=torch.device(device), seed=seed, log=None, quantize=quantize)
        return model

    def materialize(self, model: torch.nn.Module, recipe: Recipe, *, device: torch.device, seed: int,
                    log: Any, quantize: dict[str, str] | None = None) -> None:
        if recipe.model.path is not None:
            build.load_weights(model, recipe, device=device, log=log, quantize=quantize)
        else:
            build.init_weights(model, device=device, seed=seed, log=log, quantize=quantize)

    def export(self, model: torch.nn.Module, recipe: Recipe, out_dir: pathlib.Path, *, positions: int = 0) -> None:
        build.widen_context(model.config, positions=positions)
        build.export(model, processor=self.config(recipe)[1], out_dir=out_dir)

    def prompt_inputs(self, recipe: Recipe, *, text: str, images: Sequence[str],
                      videos: Sequence[str] = ()) -> dict[str, torch.Tensor]:
        from weft.plugins.batching.samples import video_limits
        from weft.plugins.models.prompt import prompt_inputs

        processor = self.config(recipe)[1]
        return prompt_inputs(processor=processor, text=text, images=images, videos=videos,
                             video_limits=video_limits(recipe, processor), system=recipe.data.system,
                             pixels=recipe.data.pixels)

    def task_inputs(self, recipe: Recipe, *, record: dict, base: pathlib.Path, choices: Sequence[str] | None,
                    reply_end: bool = False) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
        from weft.plugins.batching.samples import pad_id_of, video_limits
        from weft.plugins.models.prompt import task_inputs
        from weft.strategies.data.conversation import load_processor

        config, processor = self.config(recipe)
        pad_id = pad_id_of(load_processor(processor)[0], config) if processor is not None else 0
        return task_inputs(processor=processor, record=record, base=base, choices=choices, pad_id=pad_id,
                           video_limits=video_limits(recipe, processor), system=recipe.data.system,
                           skip_pixels=recipe.data.skip_pixels, pixels=recipe.data.pixels, reply_end=reply_end,
                           allow_outside=recipe.data.allow_outside)

    def pair_inputs(self, recipe: Recipe):
        from weft.plugins.models.pair_inputs import pair_inputs

        config, processor = self.config(recipe)
        return pair_inputs(recipe=recipe, processor=processor, config=config)

    def decode_tokens(self, recipe: Recipe, ids: Sequence[int]) -> str:
        from weft.plugins.models.prompt import decode_tokens

        return decode_tokens(processor=self.config(recipe)[1], ids=ids)

    # -- describing ----------------------------------------------------------

    def modality_of(self, path: str) -> str:
        return inventory.modality_of(path, patterns=self.modality_patterns)

    def describe(self, model: torch.nn.Module) -> list[ModuleInfo]:
        return inventory.describe_modules(model, modality_of=self.modality_of, unit_patterns=self.unit_patterns)

    def text_decoder(self, model: torch.nn.Module) -> torch.nn.Module:
        from weft.plugins.models.sp_hooks import text_decoder

        return text_decoder(model)

    def vision_tower(self, model: torch.nn.Module) -> torch.nn.Module | None:
        from weft.plugins.models.sp_hooks import vision_tower

        return vision_tower(model, modality_of=self.modality_of)

    def positions(self, model: torch.nn.Module) -> Callable[[Any], torch.Tensor]:
        from weft.plugins.models.rope_index import document_positions

        return document_positions(model)

    def rope_summary(self, config: Any, *, recipe: Recipe) -> dict:
        return build.rope_summary(config, recipe=recipe)

    # -- running -------------------------------------------------------------

    def sequence_parallel(self, model: torch.nn.Module, *, plan: Any, mesh: Any) -> Any:
        from weft.plugins.models.sp_hooks import SequenceParallelHooks

        return SequenceParallelHooks(model=model, split=build.text_split(plan=plan, mesh=mesh),
                                     text=self.text_decoder(model),
                                     visual=self.vision_tower(model), sp_group=mesh.sp.get_group(),
                                     sp_rank=mesh.sp.get_local_rank(), sp_world=plan.mesh.sp,
                                     share_threshold=plan.vision_share_threshold())

    def keep_vision_alive(self, model: torch.nn.Module) -> Any:
        from weft.plugins.models.vision_sync import VisionKeepAlive

        return VisionKeepAlive(visual=self.vision_tower(model), embed=self.text_decoder(model).embed_tokens,
                               model=model)

    def fuse_projections(self, model: torch.nn.Module) -> int:
        from weft.strategies.model.fused_linears import fuse_siblings

        return fuse_siblings(model, groups=self.fused_siblings)

    def watch_positions(self, model: torch.nn.Module, *, recipe: Recipe, log: Any) -> Any:
        from weft.plugins.models.positions import PositionWatch

        context, trained = build.trained_context(model.config, original=recipe.model.rope_original_max)
        return PositionWatch(decoder=self.text_decoder(model), context=context, original=trained,
                             scaling=recipe.model.rope_scaling, log=log)
