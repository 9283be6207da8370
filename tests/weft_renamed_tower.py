"""Test-only model family whose vision tower is not called ``visual``: tiny Qwen2.5-VL with the
tower at ``model.image_encoder``. Loaded in process (``pm.register``) or into `weft`
commands through a real entry point (tests/plugin_site.py).

transformers' Qwen2.5-VL code reads ``self.visual``; here that is a property of a subclass
that returns ``image_encoder``, so the module tree (what the family describes and the
rules match) has no ``visual`` anywhere. Nothing of transformers is patched: the family's
own classes subclass it. Its modality table names the tower by its own path, so whatever
weft still recognised by the name ``visual`` would treat the tower as text.
"""

from __future__ import annotations

import pathlib

import attrs
import torch
from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as qwen

from weft.core.hookspecs import hookimpl
from weft.plugins.models.base import TransformersFamily

MODEL_TYPE = "renamed_tower_vl"
TOWER = "image_encoder"


class RenamedTowerModel(qwen.Qwen2_5_VLModel):
    def __init__(self, config) -> None:
        super().__init__(config)
        # The same tower under another name: registered once, as image_encoder.
        setattr(self, TOWER, self._modules.pop("visual"))

    @property
    def visual(self) -> torch.nn.Module:  # what transformers' forward reads
        return getattr(self, TOWER)


class RenamedTowerForConditionalGeneration(qwen.Qwen2_5_VLForConditionalGeneration):
    def __init__(self, config) -> None:
        super().__init__(config)
        # transformers' __init__ builds its own Qwen2_5_VLModel: replaced (built on meta, so free).
        self.model = RenamedTowerModel(config)
        self.post_init()


@attrs.frozen(kw_only=True)
class RenamedTowerFamily(TransformersFamily):
    """Qwen2.5-VL's building blocks under this family's model_type, built from its own classes."""

    def config(self, recipe):
        from weft.core.recipe.presets import build_config, load_preset, preset_location

        _, kwargs, processor = load_preset(preset_location(recipe))
        # The tower's code is Qwen2.5-VL's: its config class, under this family's own model_type.
        return build_config("qwen2_5_vl", kwargs), recipe.model.processor or processor

    def build(self, recipe, *, device, seed):
        config = self.config(recipe)[0]
        with torch.device("meta"):
            model = RenamedTowerForConditionalGeneration._from_config(config, dtype=torch.float32)
        if str(device) != "meta":
            self.materialize(model, recipe, device=torch.device(device), seed=seed, log=None)
        return model


RENAMED_TOWER = RenamedTowerFamily(
    name=MODEL_TYPE, model_types=(MODEL_TYPE,), auto_class="AutoModelForImageTextToText",
    summary="test: tiny Qwen2.5-VL whose vision tower is model.image_encoder",
    modality_patterns=((f"*{TOWER}.merger*", "projector"), (f"*{TOWER}*", "vision"),
                       ("*embed_tokens", "embedding"), ("lm_head", "head")),
    unit_patterns=(f"*{TOWER}.merger", "*embed_tokens", "lm_head"),
)


@hookimpl
def weft_models():
    return [RENAMED_TOWER]


def write_preset(folder: pathlib.Path) -> pathlib.Path:
    """The bundled qwen2_5_vl_tiny preset under this family's model_type, written to ``folder``."""
    import importlib.resources

    text = (importlib.resources.files("weft.recipes") / "presets" / "qwen2_5_vl_tiny.toml").read_text()
    assert 'model_type = "qwen2_5_vl"' in text
    path = pathlib.Path(folder) / f"{MODEL_TYPE}_tiny.toml"
    path.write_text(text.replace('model_type = "qwen2_5_vl"', f'model_type = "{MODEL_TYPE}"'))
    return path
