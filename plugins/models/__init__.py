"""Built-in model families, declared through ``weft_models``: Qwen2.5-VL, Qwen2-VL,
Qwen3-VL and text-only Qwen2/Llama. Each is a :class:`TransformersFamily`; the core
finds them by ``config.model_type`` and never names them."""

from __future__ import annotations

from weft.core.hookspecs import hookimpl


@hookimpl
def weft_models():
    from weft.plugins.models.families import FAMILIES

    return list(FAMILIES)
