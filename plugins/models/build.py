"""Build the recipe's model: a named preset (random init) or a local HF directory."""

from __future__ import annotations

import pathlib
from typing import Any

import torch
import transformers

from weft.core.errors import RecipeError
from weft.core.recipe import Recipe
from weft.strategies.presets import build_config, load_preset
from weft.strategies.yarn import trained_positions, yarn_parameters

#: model_type -> the transformers auto class that trains it.
VISION_LANGUAGE = ("qwen2_5_vl", "qwen2_vl")


def model_config(recipe: Recipe) -> tuple[transformers.PretrainedConfig, str | None]:
    """The transformers config and the processor folder (bundled name or path)."""
    if recipe.model.preset is not None:
        model_type, kwargs, processor = load_preset(recipe.model.preset)
        config = build_config(model_type, kwargs)
    else:
        path = model_dir(recipe)
        if not (path / "config.json").is_file():
            raise RecipeError(f"model.path {str(path)!r} is not a Hugging Face model directory (no config.json)", where=recipe.source)
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        processor = str(path)
    if recipe.model.rope_scaling == "yarn":
        apply_yarn(config, factor=recipe.model.rope_factor, original=recipe.model.rope_original_max)
    return config, recipe.model.processor or processor


def text_config(config: transformers.PretrainedConfig) -> transformers.PretrainedConfig:
    """The config the text decoder (and its rotary embedding) is built from."""
    return getattr(config, "text_config", None) or config


def trained_context(config: transformers.PretrainedConfig, *, original: int = 0) -> tuple[int, int]:
    """(positions the text decoder's rotary embedding holds as configured, YaRN included;
    positions it was trained on). ``original``: model.rope_original_max, 0 = the config's."""
    text = text_config(config)
    rope = text.rope_parameters or {}
    if rope.get("rope_type") == "yarn":
        trained = int(rope["original_max_position_embeddings"])
        return int(trained * rope["factor"]), trained
    trained = trained_positions(rope, max_position_embeddings=text.max_position_embeddings, original=original)
    return trained, trained


def apply_yarn(config: transformers.PretrainedConfig, *, factor: float, original: int) -> None:
    """YaRN on the text decoder's rotary embedding, in place; transformers computes it."""
    text = text_config(config)
    rope = dict(text.rope_parameters or {})
    original = trained_positions(rope, max_position_embeddings=text.max_position_embeddings, original=original)
    text.rope_parameters = yarn_parameters(rope, factor=factor, original=original)
    text.max_position_embeddings = int(original * factor)


def model_dir(recipe: Recipe) -> pathlib.Path:
    path = pathlib.Path(recipe.model.path)  # type: ignore[arg-type]
    return path if path.is_absolute() else pathlib.Path(recipe.source).parent / path


def build_model(recipe: Recipe, *, device: torch.device | str, seed: int) -> torch.nn.Module:
    """Random init from the preset (seeded, identical on every rank) or load local weights.

    On the meta device only the structure is built (weights come later, per shard).
    """
    config, _ = model_config(recipe)
    auto = transformers.AutoModelForImageTextToText if config.model_type in VISION_LANGUAGE else transformers.AutoModelForCausalLM
    if recipe.model.path is not None and str(device) != "meta":
        return auto.from_pretrained(model_dir(recipe), config=config, local_files_only=True, dtype=torch.float32).to(device)
    torch.manual_seed(seed)
    with torch.device(device):
        return auto.from_config(config, dtype=torch.float32)


def load_weights(model: torch.nn.Module, recipe: Recipe, *, device: torch.device, log) -> None:
    """Materialise a meta-device (sharded) model and fill it from the recipe's model directory."""
    from weft.strategies.sharded_load import load_sharded, reset_non_persistent_buffers

    model.to_empty(device=device)
    tied = {"lm_head.weight": "model.language_model.embed_tokens.weight"} if getattr(model.config, "tie_word_embeddings", False) else None
    if tied and not any(n == "model.language_model.embed_tokens.weight" for n, _ in model.named_parameters()):
        tied = {"lm_head.weight": "model.embed_tokens.weight"}
    tensors = load_sharded(model, model_dir(recipe), tied=tied)
    rotary = reset_non_persistent_buffers(model)
    log.info("weights.loaded", path=str(model_dir(recipe)), tensors=tensors, rotary_tables=rotary)


def watch_positions(model: torch.nn.Module, *, recipe: Recipe, log) -> Any:
    """Warn once when the text decoder is fed positions past its rotary context."""
    from weft.plugins.models.positions import PositionWatch

    context, trained = trained_context(model.config, original=recipe.model.rope_original_max)
    return PositionWatch(model=model, context=context, original=trained, scaling=recipe.model.rope_scaling, log=log)


def rope_summary(config: transformers.PretrainedConfig, *, recipe: Recipe) -> dict:
    """The text decoder's rotary context, for `weft plan`."""
    context, trained = trained_context(config, original=recipe.model.rope_original_max)
    return {"scaling": recipe.model.rope_scaling, "factor": recipe.model.rope_factor, "trained_positions": trained, "context": context}
