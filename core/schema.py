"""The path plugin authors import params helpers from (docs/plugins.md, the example plugin):
``from weft.core.schema import in_range``. The schema lives in core/recipe/convert.py."""

from weft.core.recipe.convert import Where, build, did_you_mean, field_docs, in_range

__all__ = ["Where", "build", "did_you_mean", "field_docs", "in_range"]
