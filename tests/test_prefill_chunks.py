"""Chunked prefill (``kv_cache = { strategy = "static", prefill_chunk_tokens = N }``): a later
chunk's attention over the rows before it and its own equals causal attention over the whole
prompt; chunk boundaries never split an image or a video; each item's pixels go with its
tokens. (That `weft generate` in chunks gives transformers' tokens: tests/test_generate.py.)"""

from __future__ import annotations

import pytest
import torch

from weft.core.infer.prefill_chunks import chunk_bounds, vision_items
from weft.strategies.attention.chunk_prefill import prefix_chunk_attention

pytestmark = pytest.mark.quick


@pytest.mark.parametrize("start", [0, 1, 10, 36])
def test_a_chunk_attends_as_the_whole_prompts_causal_attention(start):
    torch.manual_seed(0)
    b, hq, hkv, s, d = 1, 4, 2, 37, 16  # GQA: two query heads a key head
    q, k, v = (torch.randn(b, h, s, d, dtype=torch.float64) for h in (hq, hkv, hkv))
    whole = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                             is_causal=True)
    got = prefix_chunk_attention(q[:, :, start:], k, v, start=start, scale=d**-0.5)
    assert got.dtype == torch.float64 and got.shape == (b, hq, s - start, d)
    torch.testing.assert_close(got, whole[:, :, start:], rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="expected 3 before it"):
        prefix_chunk_attention(q[:, :, 5:], k, v, start=3, scale=d**-0.5)


@pytest.mark.parametrize("chunk", [1, 4, 5, 7, 16, 100])
def test_chunk_bounds_cover_the_prompt_and_never_split_a_span(chunk):
    spans = [(3, 9), (9, 12), (20, 41), (50, 51)]  # adjacent items, one longer than most chunks
    bounds = chunk_bounds(60, chunk=chunk, spans=spans)
    assert bounds[0][0] == 0 and bounds[-1][1] == 60
    assert all(a < b for a, b in bounds) and all(x[1] == y[0] for x, y in zip(bounds, bounds[1:]))
    cuts = {a for a, _ in bounds[1:]}
    assert not any(a < cut < b for a, b in spans for cut in cuts), bounds
    for a, b in bounds:  # no longer than a chunk unless it is one span longer than a chunk
        assert b - a <= chunk or (a, b) in spans, (a, b)


def test_each_image_takes_its_own_pixels():
    class Config:
        image_token_id, video_token_id = 7, 8

    ids = torch.tensor([[1, 7, 7, 2, 7, 7, 7, 7, 3]])  # two images: 2 and 4 tokens
    grid = torch.tensor([[1, 2, 4], [1, 4, 4]])  # 8 and 16 patches (2 x 2 merged into a token)
    pixels = torch.arange(24.0)[:, None].expand(24, 3)
    items = vision_items(Config(), {"input_ids": ids, "pixel_values": pixels, "image_grid_thw": grid})
    assert [i["span"] for i in items] == [(1, 3), (4, 8)]
    assert torch.equal(torch.cat([i["pixel_values"] for i in items]), pixels)
    assert [i["image_grid_thw"].tolist() for i in items] == [[[1, 2, 4]], [[1, 4, 4]]]
    # Runs that do not pair with the grid rows one to one: one span over all of them, all inputs with it.
    items = vision_items(Config(), {"input_ids": ids, "pixel_values": pixels, "image_grid_thw": grid[:1]})
    assert [i["span"] for i in items] == [(1, 8)] and items[0]["pixel_values"] is pixels


def test_auto_chunks_only_where_the_whole_prefill_does_not_fit(monkeypatch):
    """``prefill_chunk_tokens = "auto"``: the whole prompt where the GPU's free memory, less the
    cache to come, holds its prefill's peak; else the largest multiple of 4096 tokens that fits.
    The 7B's shapes on an H200 with 120 GiB free: 128K whole, 1M in chunks; off the GPU, whole."""
    import types

    from weft.core.infer.prefill_chunks import (
        CHUNK_MULTIPLE,
        MARGIN_BYTES,
        PEAK_BYTES_PER_WIDTH,
        auto_chunk,
        cache_itemsize,
        prefill_chunk_for,
    )

    gib = 2**30
    assert auto_chunk(prompt=1000, width=10, free=60_000) == 0
    assert auto_chunk(prompt=10**6, width=10, free=60 * 4096 * 50) == 4096 * 50
    assert auto_chunk(prompt=10**6, width=10, free=10) == CHUNK_MULTIPLE  # never fewer than one multiple

    class Model(torch.nn.Module):
        config = types.SimpleNamespace(num_hidden_layers=28, num_key_value_heads=4, head_dim=128, hidden_size=3584,
                                       num_attention_heads=28, intermediate_size=18944)

        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1, dtype=torch.bfloat16))

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (120 * gib, 141 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 2 * gib)  # 1 GiB spare in the allocator
    gpu, model = torch.device("cuda"), Model()
    bf16 = {"device": gpu, "precision": "bf16"}
    assert prefill_chunk_for("auto", model=model, prompt=131072, cached_tokens=131172, **bf16) == 0
    prompt = 1 << 20
    chunk = prefill_chunk_for("auto", model=model, prompt=prompt, cached_tokens=prompt + 100, **bf16)
    cache = 2 * 28 * 4 * 128 * 2 * (prompt + 100)  # 56 GiB of keys and values
    free = 121 * gib - cache - MARGIN_BYTES
    per_token = 18944 * PEAK_BYTES_PER_WIDTH
    assert 0 < chunk < prompt and chunk % CHUNK_MULTIPLE == 0
    assert chunk * per_token <= free < (chunk + CHUNK_MULTIPLE) * per_token
    assert prefill_chunk_for(20, model=model, prompt=prompt, cached_tokens=prompt, device=gpu,
                             precision="bf16") == 20  # the rule's
    # The cache's element: bf16 under bf16 autocast whatever the weights (a 4-bit base's uint8
    # storage included); in float32 the widest floating weight's.
    assert cache_itemsize(model, precision="bf16") == 2 and cache_itemsize(model, precision="fp32") == 2
    model.packed = torch.nn.Parameter(torch.zeros(4, dtype=torch.uint8), requires_grad=False)
    model.wide = torch.nn.Parameter(torch.zeros(1))
    assert cache_itemsize(model, precision="fp32") == 4 and cache_itemsize(model, precision="bf16") == 2
    assert prefill_chunk_for("auto", model=model, prompt=prompt, cached_tokens=prompt, device=torch.device("cpu"),
                             precision="bf16") == 0
