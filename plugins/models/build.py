"""Build the recipe's model (a named preset at random, or a local HF directory), load and
export its weights: the shared part of every built-in model family."""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import torch
import transformers

from weft.core.errors import RecipeError, WeftError
from weft.core.models import ties_embeddings
from weft.core.recipe import Recipe
from weft.core.recipe.presets import build_config, load_preset, preset_location
from weft.core.run.model_files import own_code_error
from weft.strategies.model.yarn import scaled_parameters, trained_positions

#: Files of a processor folder that travel with an exported model (not weights).
PROCESSOR_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "preprocessor_config.json", "video_preprocessor_config.json", "chat_template.json",
                   "chat_template.jinja", "processor_config.json", "generation_config.json", "added_tokens.json",
                   "tokenizer.model")


def model_config(recipe: Recipe) -> tuple[transformers.PretrainedConfig, str | None]:
    """The transformers config and the processor folder (bundled name or path)."""
    if recipe.model.preset is not None:
        model_type, kwargs, processor = load_preset(preset_location(recipe))
        config = build_config(model_type, kwargs)
    else:
        path = recipe.model_dir()
        if not (path / "config.json").is_file():
            raise RecipeError(f"model.path {str(path)!r} is not a Hugging Face model directory (no config.json)",
                              where=recipe.source)
        try:
            # Never the directory's own code (an auto_map in config.json): transformers' classes only.
            config = transformers.AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
        except (ValueError, KeyError, OSError) as error:
            if "trust_remote_code" in str(error):  # only the directory's own code could read it: weft's words
                raise own_code_error(path / "config.json", where=f"{recipe.source} (model.path)") from None
            raise RecipeError(f"{path / 'config.json'}: transformers cannot read it: {error}",
                              where=f"{recipe.source} (model.path)") from None
        processor = str(path)
    if recipe.model.rope_scaling != "none":
        apply_rope_scaling(config, kind=recipe.model.rope_scaling, factor=recipe.model.rope_factor,
                           original=recipe.model.rope_original_max)
    return config, _named_processor(recipe) or processor


def _named_processor(recipe: Recipe) -> str | None:
    """``model.processor``: a bundled name as given, a path relative to the recipe (as model.path)."""
    named = recipe.model.processor
    if named is None or ("/" not in named and os.sep not in named):
        return named
    return str(recipe.relative(named))


def text_config(config: transformers.PretrainedConfig) -> transformers.PretrainedConfig:
    """The config the text decoder (and its rotary embedding) is built from."""
    return getattr(config, "text_config", None) or config


def trained_context(config: transformers.PretrainedConfig, *, original: int = 0) -> tuple[int, int]:
    """(positions the text decoder's rotary embedding holds as configured, YaRN included;
    positions it was trained on). ``original``: model.rope_original_max, 0 = the config's."""
    text = text_config(config)
    rope = text.rope_parameters or {}
    if rope.get("rope_type") in ("yarn", "linear"):
        trained = int(rope["original_max_position_embeddings"])
        return int(trained * rope["factor"]), trained
    trained = trained_positions(rope, max_position_embeddings=text.max_position_embeddings, original=original)
    return trained, trained


def widen_context(config: transformers.PretrainedConfig, *, positions: int) -> None:
    """A model trained unscaled on ``positions`` positions, past its config's
    ``max_position_embeddings``, announces them, in place: the next run's watch and a later
    YaRN factor (scaled over ``max_position_embeddings``) then count from what was trained,
    not from the preset's context. A scaled rotary embedding keeps the context it declares."""
    text = text_config(config)
    rope = text.rope_parameters or {}
    if rope.get("rope_type", "default") == "default" and positions > text.max_position_embeddings:
        text.max_position_embeddings = int(positions)


def apply_rope_scaling(config: transformers.PretrainedConfig, *, kind: str, factor: float, original: int) -> None:
    """YaRN, linear or dynamic-NTK scaling of the text decoder's rotary embedding, in place;
    transformers computes the tables from ``rope_parameters``. Dynamic NTK keeps the trained
    context as the config's (it stretches at run time past it); the others announce the
    stretched one."""
    text = text_config(config)
    rope = dict(text.rope_parameters or {})
    original = trained_positions(rope, max_position_embeddings=text.max_position_embeddings, original=original)
    text.rope_parameters = scaled_parameters(rope, kind=kind, factor=factor, original=original)
    text.max_position_embeddings = int(original * factor) if kind != "dynamic" else original


def from_pretrained(recipe: Recipe, *, auto_class: str, config: Any, device: torch.device | str) -> torch.nn.Module:
    """The whole model with ``model.path``'s weights (the unsharded reference of `weft check`)."""
    auto = getattr(transformers, auto_class)
    # safetensors only: a pickled pytorch_model.bin beside them is never read.
    model = auto.from_pretrained(recipe.model_dir(), config=config, local_files_only=True, dtype=torch.float32,
                                 use_safetensors=True, trust_remote_code=False)
    return model.to(device)


def on_meta(*, auto_class: str, config: Any) -> torch.nn.Module:
    """The structure only, through transformers' ``auto_class``: no storage, no init."""
    with torch.device("meta"):
        return getattr(transformers, auto_class).from_config(config, dtype=torch.float32)


def init_weights(model: torch.nn.Module, *, device: torch.device, seed: int, log: Any,
                 quantize: dict[str, str] | None = None) -> None:
    """A preset's random init on a meta-device model, sharded or whole: storage on ``device``,
    then each rank draws only its rows, from the seed and the parameter's name on the CPU's
    generator, so the weights are the same whatever the world size and the device
    (strategies/model/seeded_init.py); rotary tables and other non-persistent buffers recomputed.
    ``quantize``: {unit path: method}: those units materialised and quantised one at a time."""
    from weft.strategies.model.seeded_init import init_parameters
    from weft.strategies.model.sharded_load import reset_non_persistent_buffers

    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    std = float(getattr(config, "initializer_range", None) or getattr(model.config, "initializer_range", 0.02))
    filled = _materialize(model, device=device, quantize=quantize, log=log,
                          fill=lambda include: init_parameters(model, seed=seed, std=std, include=include))
    rotary = reset_non_persistent_buffers(model)
    if log is not None:
        log.info("weights.initialised", seed=seed, std=std, parameters=filled, rotary_tables=rotary)


def quantize_units(model: torch.nn.Module, quantize: dict[str, str]) -> None:
    """{unit path: method}: those units' linear weights quantised in place (a model already whole)."""
    from weft.strategies.model.quantize import quantize_linears

    for path, method in quantize.items():
        quantize_linears(model.get_submodule(path), method=method)


def _materialize(model: torch.nn.Module, *, device: torch.device, quantize: dict[str, str] | None, fill,
                 log: Any) -> int:
    """Storage for every tensor and ``fill``'s values; with ``quantize``, unit by unit, each unit's
    linear weights quantised before the next one exists in full precision."""
    if not quantize:
        model.to_empty(device=device)
        retie(model)
        return fill(None)
    from weft.strategies.model.materialize import materialize_in_parts
    from weft.strategies.model.quantize import quantize_linears

    totals: dict[str, int] = {}

    def finish(path: str, module: torch.nn.Module) -> None:
        for key, value in quantize_linears(module, method=quantize[path]).items():
            totals[key] = totals.get(key, 0) + value

    filled = materialize_in_parts(model, device=device, parts=list(quantize), fill=fill, finish=finish)
    retie(model)
    if log is not None:
        log.info("weights.quantized", units=len(quantize), methods=sorted(set(quantize.values())), **totals)
    return filled


def text_split(*, plan: Any, mesh: Any) -> Any:
    """This rank's place in the sequence-parallel group, in the layout the text attention uses."""
    from weft.strategies.sequence.model_split import TextSplit

    return TextSplit(
        ring=plan.mesh.ring, ring_rank=mesh["ring"].get_local_rank(),
        ulysses=plan.mesh.ulysses, ulysses_rank=mesh["ulysses"].get_local_rank(),
        layout=plan.sequence_layout(),
    )


def export(model: torch.nn.Module, *, processor: str | None, out_dir: pathlib.Path) -> None:
    """save_pretrained plus the processor folder's files, so from_pretrained(out_dir) loads it."""
    import shutil

    from weft.strategies.data.conversation import processor_dir

    model.save_pretrained(out_dir, safe_serialization=True)
    if processor is None:
        return
    source = processor_dir(processor)
    for name in PROCESSOR_FILES:
        if (source / name).is_file() and not (out_dir / name).exists():
            shutil.copy2(source / name, out_dir / name)


def retie(model: torch.nn.Module) -> None:
    """Tied embeddings after ``to_empty``: it gives each module its own new tensor, so a whole
    model is tied again (transformers' tie_weights); a sharded one keeps its tie inside its
    FSDP unit (the shard plugin puts a tied head and embedding in the root unit)."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or not ties_embeddings(model.config):
        return
    if not hasattr(head.weight, "device_mesh"):
        model.tie_weights()
    if head.weight is not embed.weight:
        raise RuntimeError("tie_word_embeddings: the head and the embedding no longer share their weight after "
                           "materialising; shard them in one FSDP unit")


def load_weights(model: torch.nn.Module, recipe: Recipe, *, device: torch.device, log,
                 quantize: dict[str, str] | None = None) -> None:
    """Materialise a meta-device (sharded) model and fill it from the recipe's model directory
    (``quantize``: as ``init_weights``)."""
    from weft.strategies.model.sharded_load import load_sharded, reset_non_persistent_buffers

    tied = ({"lm_head.weight": "model.language_model.embed_tokens.weight"}
            if getattr(model.config, "tie_word_embeddings", False) else None)
    if tied and not any(n == "model.language_model.embed_tokens.weight" for n, _ in model.named_parameters()):
        tied = {"lm_head.weight": "model.embed_tokens.weight"}
    try:
        tensors = _materialize(model, device=device, quantize=quantize, log=log,
                               fill=lambda include: load_sharded(model, recipe.model_dir(), tied=tied, include=include))
    except (ValueError, KeyError, FileNotFoundError, json.JSONDecodeError) as error:
        raise WeftError(f"cannot load the weights: {error}", where=f"{recipe.source} (model.path)") from None
    rotary = reset_non_persistent_buffers(model)
    log.info("weights.loaded", path=str(recipe.model_dir()), tensors=tensors, rotary_tables=rotary)


def rope_summary(config: transformers.PretrainedConfig, *, recipe: Recipe) -> dict:
    """The text decoder's rotary context, for `weft plan`."""
    context, trained = trained_context(config, original=recipe.model.rope_original_max)
    return {"scaling": recipe.model.rope_scaling, "factor": recipe.model.rope_factor, "trained_positions": trained,
            "context": context}
