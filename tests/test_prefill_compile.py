"""A prefill under a rule's compile into weft's caches compiles the attention a fixed number
of times, whatever the number of layers (core/infer/decode.py ``layer_index_dynamic``,
the caches' ``update`` out of the trace: static, sharded, paged): before, each layer's index
and layer object were guards, one compilation per layer until torch's recompile limit left the
remaining layers eager. The compiled prefill's logits equal the eager model's."""

from __future__ import annotations

import pytest
import torch

from weft.core.infer.decode import layer_index_dynamic
from weft.core.recipe.presets import build_config, load_preset
from weft.plugins.kv_cache.static import StaticCache
from weft.strategies.memory.compile_units import compile_unit

pytestmark = pytest.mark.quick


def _model(layers: int) -> torch.nn.Module:
    from transformers import AutoModelForImageTextToText

    model_type, kwargs, _ = load_preset("qwen2_5_vl_tiny")
    kwargs["text_config"] = {**kwargs["text_config"], "num_hidden_layers": layers}
    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(build_config(model_type, kwargs)).eval()


def _cache(kind: str, layers: int):
    if kind == "static":
        cache = StaticCache(num_layers=layers)
        cache.reserve(48 + 4)
        cache.begin_prefill(keep=None, prompt=48)
        return cache
    from weft.plugins.kv_cache.paged import PagedCache
    from weft.plugins.kv_cache.sharded import ShardedCache

    sp = {"num_layers": layers, "rank": 0, "world": 1, "group": None}
    cache = ShardedCache(**sp) if kind == "sharded" else PagedCache(**sp, page_tokens=16)
    cache.begin_prefill(keep=None, prompt=48)
    return cache


def _compiled_prefill(layers: int, kind: str = "static") -> tuple[int, torch.Tensor, torch.Tensor]:
    """(graphs the backend was handed, compiled logits, eager logits) of one 48-token prefill."""
    model = _model(layers)
    ids = torch.randint(0, 300, (1, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        eager = model(input_ids=ids, logits_to_keep=1).logits
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    for layer in model.model.language_model.layers:
        compile_unit(layer, backend=counting, attention=True)
    cache = _cache(kind, layers)
    with torch.no_grad(), layer_index_dynamic():
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    torch._dynamo.reset()
    return len(graphs), logits, eager


@pytest.mark.parametrize("kind", ["static", "sharded", "paged"])
def test_the_compiled_attention_does_not_recompile_per_layer(kind):
    few, logits, eager = _compiled_prefill(3, kind)
    many, _, _ = _compiled_prefill(10, kind)
    assert many == few, f"{few} graphs for 3 layers, {many} for 10: a compilation per layer"
    torch.testing.assert_close(logits, eager, rtol=1e-5, atol=1e-5)
