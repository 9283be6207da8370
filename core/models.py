"""The model-family contract: what the core asks of a model, and how it finds who answers.

A model family (Qwen2.5-VL, Qwen2-VL, Qwen3-VL, Qwen2/Llama text...) is an object
that a plugin declares through the ``weft_models`` hook. The core never names a
family: it reads the ``model_type`` the recipe's model has (a preset's, or the
``config.json`` of ``model.path``) and asks the plugin manager for the family that
handles it. An unknown ``model_type`` is a user error listing the families installed.

``ModelFamily`` below is the whole contract, as a Protocol: any object with these
attributes and methods will do. weft's built-in families share one base class,
``weft.plugins.models.base.TransformersFamily``, that a third-party family can
subclass too (docs/architecture.md, "Adding a model family").
"""

from __future__ import annotations

import json
import pathlib
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol, Sequence, runtime_checkable

from weft.core.errors import RecipeError

if TYPE_CHECKING:  # the contract's types; importing them at run time would pull torch
    import torch
    import transformers

    from weft.core.mesh import WeftMesh
    from weft.core.recipe import Recipe
    from weft.core.recipe.rule_engine import ModuleInfo, Plan


@runtime_checkable
class SequenceSplit(Protocol):
    """What ``ModelFamily.sequence_parallel`` returns: hooks installed on the model that
    cut its sequence (after the vision merge) to this rank's part, and the same cut
    for the tensors the core shards itself (the shifted labels)."""

    #: Sequence lengths must be a multiple of this; the core pads micro-batches to it.
    multiple: int

    def shard(self, x: torch.Tensor, *, dim: int) -> torch.Tensor:
        """This rank's part of a whole-sequence tensor along ``dim``."""

    def remove(self) -> None:
        """Take the hooks off the model."""


@runtime_checkable
class PositionWatch(Protocol):
    """What ``ModelFamily.watch_positions`` returns: the largest position id the text
    decoder was fed (without host syncs in the step), against its rotary context."""

    context: int

    @property
    def largest(self) -> int: ...

    def poll(self) -> None:
        """Once per step, after the step's own syncs: warn once past the context."""

    def resumed(self, largest: int) -> None:
        """The largest position id of the run before it was resumed (its checkpoint's):
        ``largest`` then covers the whole run, not only the steps since."""


@runtime_checkable
class ModelFamily(Protocol):
    """One model family. Every method takes keyword arguments after the first."""

    #: Short name shown by `weft plugins` and in errors ("qwen2_5_vl").
    name: str
    #: The ``config.model_type`` values this family handles.
    model_types: tuple[str, ...]
    #: One line for `weft plugins`.
    summary: str

    def config(self, recipe: Recipe) -> tuple[transformers.PretrainedConfig, str | None]:
        """The transformers config (YaRN applied from ``[model]``) and the processor folder."""

    def build(self, recipe: Recipe, *, device: torch.device | str, seed: int,
              quantize: dict[str, str] | None = None) -> torch.nn.Module:
        """The whole model through its transformers auto class: on ``meta`` only the
        structure; else weights from ``model.path``, or a preset's random init from ``seed``
        (the same values ``materialize`` gives a sharded model: the unsharded reference).
        ``quantize``: as ``materialize`` (passed only when a rule asks for it)."""

    def materialize(self, model: torch.nn.Module, recipe: Recipe, *, device: torch.device, seed: int,
                    log: Any, quantize: dict[str, str] | None = None) -> None:
        """Give a meta-device model (sharded or not) its storage on ``device`` and its weights:
        each rank reads only its shards of ``model.path``, or draws only its rows of a
        preset's random init, which depends on the seed alone (not the world size, not the
        device); no process ever holds the whole model. ``quantize`` ({unit path: method},
        passed only when a rule asks for it): those units' linear weights stored quantised,
        each unit quantised before the next is materialised (strategies/model/materialize.py)."""

    def describe(self, model: torch.nn.Module) -> list[ModuleInfo]:
        """Root first, then shard units and attention modules with modality and heads."""

    def modality_of(self, path: str) -> str:
        """vision, projector, text, embedding or head, for a module path."""

    def text_decoder(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module whose forward takes the merged sequence (embeddings, position ids)."""

    def vision_tower(self, model: torch.nn.Module) -> torch.nn.Module | None:
        """The vision encoder, or None for a text-only model."""

    def positions(self, model: torch.nn.Module) -> Callable[[Any], torch.Tensor]:
        """``fn(sample) -> (..., L)``: one document's position ids through the model's own
        rope index (3-D mRoPE for vision-language models); ``model`` may be on meta."""

    def sequence_parallel(self, model: torch.nn.Module, *, plan: Plan, mesh: WeftMesh) -> SequenceSplit:
        """Install the hooks that cut the model's inputs for sequence parallelism."""

    def keep_vision_alive(self, model: torch.nn.Module) -> Any:
        """Hooks that run the vision tower on a blank image when a micro-batch carries
        ``VISION_FLAG`` and no images, so FSDP's collectives stay in step across DP ranks."""

    def watch_positions(self, model: torch.nn.Module, *, recipe: Recipe, log: Any) -> PositionWatch:
        """Track the position ids the text decoder receives."""

    def fuse_projections(self, model: torch.nn.Module) -> int:
        """For inference: each group of sibling projections the family's forward calls on one
        input (query/key/value, gate/up) computed as one product with gradients off; the
        number of groups fused (0 where the family has none)."""

    def rope_summary(self, config: transformers.PretrainedConfig, *, recipe: Recipe) -> dict:
        """The text decoder's rotary context, for `weft plan`."""

    def export(self, model: torch.nn.Module, recipe: Recipe, out_dir: pathlib.Path, *, positions: int = 0) -> None:
        """Write a Hugging Face directory: weights, config and the processor's files.
        ``positions``: how many positions the run's batches reached (0: unknown); an unscaled
        rotary context shorter than that is written as that long."""

    def prompt_inputs(self, recipe: Recipe, *, text: str, images: Sequence[str],
                      videos: Sequence[str] = ()) -> dict[str, torch.Tensor]:
        """Model inputs (B = 1) for one user turn (the images, the videos, then ``text``)
        followed by the assistant's header, encoded as the training data encodes chats
        (videos sampled by ``data.video_fps`` / ``data.max_frames``): `weft generate`'s prompt."""

    def task_inputs(self, recipe: Recipe, *, record: dict, base: pathlib.Path, choices: Sequence[str] | None,
                    reply_end: bool = False) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
        """`weft eval --task`'s question (a conversation record in any data format, its paths
        relative to ``base``): its prompt inputs (B = 1) ending with the assistant's header, as
        ``prompt_inputs``; and for each of ``choices`` one micro-batch, the question with the
        choice as the reply, labelled on the choice's own tokens only (not the reply's header nor,
        unless ``reply_end``, its closing token). ValueError or OSError when the record cannot be
        read."""

    def pair_inputs(self, recipe: Recipe) -> Iterator[tuple[str, str, Any]]:
        """`weft eval --reference`: every record of the recipe's data files, in order, as (where,
        the record as a JSON line, (chosen, rejected) or the reason it is a bad sample): a
        preference pair encoded as training encodes it, each conversation one micro-batch
        (B = 1) labelled on its response."""

    def decode_tokens(self, recipe: Recipe, ids: Sequence[int]) -> str:
        """Token ids as text, with the model's tokenizer ("" when the model has none)."""


#: Key the core adds to a micro-batch without images when another data-parallel rank
#: has some: the family's ``keep_vision_alive`` hooks run the tower on a blank image.
VISION_FLAG = "weft_needs_vision"


def ties_embeddings(config: Any) -> bool:
    """Whether a transformers config (or its text config) ties the head to the embedding."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(config, "tie_word_embeddings", False) or getattr(text, "tie_word_embeddings", False))


def model_type_of(recipe: Recipe) -> str:
    """The ``model_type`` of the recipe's model, read without transformers: the preset's
    key, or ``config.json`` of ``model.path``. Raises RecipeError naming the file."""
    if recipe.model.preset is not None:
        from weft.core.recipe.presets import load_preset, preset_location

        try:
            return load_preset(preset_location(recipe))[0]
        except (OSError, ValueError) as error:
            raise RecipeError(f"model.preset {recipe.model.preset!r}: {error}",
                              where=f"{recipe.source} (model.preset)") from None
    path = recipe.model_dir()
    config = path / "config.json"
    if not config.is_file():
        raise RecipeError(f"model.path {str(path)!r} is not a Hugging Face model directory (no config.json)",
                          where=f"{recipe.source} (model.path)")
    try:
        model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError) as error:
        raise RecipeError(f"{config} is not a JSON object: {error}", where=f"{recipe.source} (model.path)") from None
    if not isinstance(model_type, str):
        raise RecipeError(f"{config} has no string 'model_type'", where=f"{recipe.source} (model.path)")
    return model_type


class ModelRegistry:
    """Every family the loaded plugins declared, by ``model_type``. Read-only after build."""

    def __init__(self, families: list[tuple[str, ModelFamily]]) -> None:
        self._by_type: dict[str, tuple[str, ModelFamily]] = {}
        for plugin, family in families:
            for model_type in family.model_types:
                if model_type in self._by_type:
                    other = self._by_type[model_type][0]
                    raise RecipeError(
                        f"model_type {model_type!r} is handled twice: by plugin {other!r} and by plugin {plugin!r}; "
                        "disable one with WEFT_DISABLE_PLUGINS"
                    )
                self._by_type[model_type] = (plugin, family)

    def get(self, model_type: str) -> ModelFamily | None:
        found = self._by_type.get(model_type)
        return found[1] if found else None

    def all(self) -> list[tuple[str, ModelFamily]]:
        """(plugin, family) pairs, one per family, in name order."""
        unique = {id(a): (p, a) for p, a in self._by_type.values()}
        return sorted(unique.values(), key=lambda pa: pa[1].name)

    def installed(self) -> str:
        return "; ".join(f"{a.name} ({', '.join(a.model_types)})" for _, a in self.all()) or "(none)"

    def for_recipe(self, recipe: Recipe) -> ModelFamily:
        """The family of the recipe's model; a RecipeError listing the installed ones if none."""
        model_type = model_type_of(recipe)
        family = self.get(model_type)
        if family is None:
            key = "model.preset" if recipe.model.preset is not None else "model.path"
            raise RecipeError(
                f"no installed model family handles model_type {model_type!r}; "
                f"families installed: {self.installed()}. "
                "A plugin adds one through the weft_models hook (docs/architecture.md)",
                where=f"{recipe.source} ({key})",
            )
        return family
