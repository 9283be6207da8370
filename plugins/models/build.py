"""Build the recipe's model: a named preset (random init) or a local HF directory."""

from __future__ import annotations

import pathlib

import torch
import transformers

from weft.core.errors import RecipeError
from weft.core.recipe import Recipe
from weft.strategies.presets import build_config, load_preset

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
    return config, recipe.model.processor or processor


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
