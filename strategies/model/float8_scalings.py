"""float8 training's scalings (torchao's recipe names), one place: the shard rule's
``float8_recipe`` accepts these, strategies/model/float8.py converts with them. No torch here:
the plugins declare their rule keys without heavy imports."""

from __future__ import annotations

import typing

Scaling = typing.Literal["rowwise", "rowwise_with_gw_hp", "tensorwise"]
RECIPES: tuple[str, ...] = typing.get_args(Scaling)
