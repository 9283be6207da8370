"""Model presets: TOML files describing random-init model shapes.

A preset holds `model_type`, an optional bundled `processor` folder name, and the
transformers config kwargs (top-level keys plus `[text_config]` / `[vision_config]`
tables). Bare names resolve to `weft.recipes/presets/<name>.toml`; anything that looks
like a path (has a separator or ends in .toml) is read from disk.
"""

from __future__ import annotations

import copy
import importlib.resources
import pathlib
import tomllib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # transformers is heavy; only build_config needs it, at call time.
    from transformers import PreTrainedConfig

_RECIPES_PACKAGE = "weft.recipes"
_RESERVED_KEYS = ("model_type", "processor")


def preset_names() -> list[str]:
    """Names of the presets shipped in weft.recipes, sorted."""
    folder = importlib.resources.files(_RECIPES_PACKAGE) / "presets"
    return sorted(p.name.removesuffix(".toml") for p in folder.iterdir() if p.name.endswith(".toml"))


def is_preset_path(name: str | pathlib.Path) -> bool:
    """A preset named by a file path (with ``/`` or ending in ``.toml``), not a bundled name."""
    text = str(name)
    return isinstance(name, pathlib.Path) or text.endswith(".toml") or "/" in text or "\\" in text


#: Keys holding file paths (and a path-like model.preset): relative to the recipe's folder, to the cwd with --set.
_PATH_KEYS = {("model", "path"), ("data", "path")}


def typed_path(section: str, name: str, value: object) -> bool:
    """Whether ``--set SECTION.NAME=VALUE`` is a path relative to the folder it was typed in:
    model.path, data.path or a path-like model.preset, unless absolute, a standard-library glob
    (``<stdlib>/...``) or, for model.path, a Hub id (``org/name``) with no such folder here (a
    folder wins, docs/models.md)."""
    key = (section, name)
    if not isinstance(value, str) or not (key in _PATH_KEYS or key == ("model", "preset") and is_preset_path(value)):
        return False
    if pathlib.Path(value).is_absolute() or value.startswith("<stdlib>/"):
        return False
    from weft.core.model_source import is_hub_id

    return key != ("model", "path") or not is_hub_id(value) or (pathlib.Path.cwd() / value).exists()


def preset_location(recipe: Any) -> str | pathlib.Path:
    """A recipe's ``model.preset``: a bundled name as given; a path as the recipe's other paths
    are (relative to its folder; one given with --set was made absolute where it was typed)."""
    name = recipe.model.preset
    return recipe.relative(name) if is_preset_path(name) else name


def load_preset(name_or_path: str | pathlib.Path) -> tuple[str, dict[str, Any], str | None]:
    """Read a preset -> (model_type, config_kwargs, processor name or None)."""
    raw = _read_preset_text(name_or_path)
    data = tomllib.loads(raw)
    model_type = data.get("model_type")
    if not isinstance(model_type, str):
        raise ValueError(f"preset {name_or_path!r} has no string `model_type`")
    processor = data.get("processor")
    if processor is not None and not isinstance(processor, str):
        raise ValueError(f"preset {name_or_path!r}: `processor` must be a string")
    config_kwargs = {k: v for k, v in data.items() if k not in _RESERVED_KEYS}
    return model_type, config_kwargs, processor


def build_config(model_type: str, config_kwargs: dict[str, Any]) -> PreTrainedConfig:
    """transformers config for `model_type`; `config_kwargs` is left untouched."""
    from transformers import AutoConfig

    # Deep copy: transformers 5 configs keep and mutate nested dicts in place
    # (e.g. rope_parameters gets defaults filled in), which would leak into the caller's
    # dict and make a second build see different input.
    config = AutoConfig.for_model(model_type, **copy.deepcopy(config_kwargs))
    _check_mrope_section(config)
    return config


def _check_mrope_section(config: PreTrainedConfig) -> None:
    """transformers skips validating mrope_section and only fails in the first forward
    (a split size error); planning on the meta device never runs one, so check here."""
    text = config.get_text_config()
    section = (getattr(text, "rope_parameters", None) or {}).get("mrope_section")
    if section is None:
        return
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    if 2 * sum(section) != head_dim:
        raise ValueError(f"mrope_section {list(section)} must sum to head_dim / 2 = {head_dim // 2}")


def _read_preset_text(name_or_path: str | pathlib.Path) -> str:
    text = str(name_or_path)
    if is_preset_path(name_or_path):
        return pathlib.Path(text).read_text(encoding="utf-8")
    resource = importlib.resources.files(_RECIPES_PACKAGE) / "presets" / f"{text}.toml"
    if not resource.is_file():
        raise FileNotFoundError(f"no bundled preset {text!r}; known: {', '.join(preset_names())}")
    return resource.read_text(encoding="utf-8")
