"""A prompt prefilled in chunks into the static cache (``kv_cache = { prefill_chunk_tokens = N }``,
or ``"auto"``, the default: in chunks only where the GPU's free memory does not hold the whole
prompt's prefill, ``prefill_chunk_for``).

A whole prompt's prefill holds every layer's activations for the whole prompt at once (at
512K tokens the 7B's MLP alone makes ~20 GB tensors); in chunks of N tokens it holds a
chunk's. Each chunk is one forward of the model with the past in the cache: its keys and
values are written after the chunks before it, and its queries attend to all of those and,
causally, to their own chunk (the cache's attention: strategies/attention/chunk_prefill.py;
the first chunk runs the recipe's own attention, as a whole prompt does). The rotary positions
are the whole prompt's, computed once (mRoPE: the model's rope index over the prompt) and
cut per chunk. An image or a video is never split: a boundary that would fall inside one
moves to its start (or, for a span longer than a chunk, to its end), and the chunk that holds
its tokens carries its pixels. Only the last chunk's last logits are kept.
"""

from __future__ import annotations

import torch

from weft.core.infer.decode import prompt_sample, text_attention

#: A prompt token's bytes at a whole prefill's peak, per element of the MLP's width: the gate's
#: and up projection's outputs and their product, bf16, in one layer at a time (nothing is kept
#: for a backward). Measured: the 7B's 128K prefill peaked at 35.3 GiB on one H200, of which
#: 15.4 weights and 7.0 cache: 105 KB a token, 5.6 bytes an element of its 18,944 (BENCHMARKS.md).
PEAK_BYTES_PER_WIDTH = 6
#: Room kept free beside the estimate (the allocator's fragments, the vision tower, the logits).
MARGIN_BYTES = 4 * 2**30
#: An automatic chunk is a multiple of this many tokens, and never fewer.
CHUNK_MULTIPLE = 4096

#: The per-item vision inputs: (token id key in the config, pixel key, grid key, per-item extras).
_VISION = (("image_token_id", "pixel_values", "image_grid_thw", ()),
           ("video_token_id", "pixel_values_videos", "video_grid_thw", ("second_per_grid_ts",)))


def _runs(ids: torch.Tensor, token: int) -> list[tuple[int, int]]:
    """The [start, end) runs of ``token`` in ``ids`` (S,)."""
    where = (ids == token).nonzero().flatten().tolist()
    runs: list[tuple[int, int]] = []
    for i in where:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def vision_items(config, inputs: dict) -> list[dict]:
    """Each image or video of the prompt: its token span [start, end) and its inputs' slices
    (its pixel rows, its grid row, its extras). One span a run of its tokens where the runs and
    the grid rows pair one to one; otherwise one span over all of that kind's tokens, with all
    of its inputs (still exact: only the chunking is coarser)."""
    ids = inputs["input_ids"][0]
    items = []
    for token_key, pixels, grids, extras in _VISION:
        token = getattr(config, token_key, None)
        if token is None or inputs.get(grids) is None:
            continue
        runs, grid = _runs(ids, token), inputs[grids]
        if len(runs) != grid.shape[0]:  # e.g. a video's frames between timestamps: one span for all
            items.append({"span": (runs[0][0], runs[-1][1]), **{k: inputs[k] for k in (pixels, grids, *extras)
                                                                 if inputs.get(k) is not None}})
            continue
        rows = grid.prod(dim=-1).tolist()  # each item's pixel rows (patches)
        offset = 0
        for i, (span, count) in enumerate(zip(runs, rows)):
            item = {"span": span, pixels: inputs[pixels][offset:offset + count], grids: grid[i:i + 1]}
            item.update({k: inputs[k][i:i + 1] for k in extras if inputs.get(k) is not None})
            items.append(item)
            offset += count
    return items


def chunk_bounds(length: int, *, chunk: int, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """[start, end) chunks of about ``chunk`` tokens over ``length``, none splitting a span."""
    bounds, start = [], 0
    while start < length:
        end = min(start + chunk, length)
        inside = next(((a, b) for a, b in spans if a < end < b), None)
        if inside is not None:
            end = inside[0] if inside[0] > start else inside[1]
        bounds.append((start, end))
        start = end
    return bounds


def auto_chunk(*, prompt: int, width: int, free: int) -> int:
    """0 (the whole prompt) when its prefill's peak fits ``free`` bytes, else the largest
    multiple of ``CHUNK_MULTIPLE`` tokens whose does (at least one multiple)."""
    per_token = width * PEAK_BYTES_PER_WIDTH
    if prompt * per_token <= free:
        return 0
    return max(CHUNK_MULTIPLE, free // per_token // CHUNK_MULTIPLE * CHUNK_MULTIPLE)


def prefill_chunk_for(setting: int | str, *, model: torch.nn.Module, prompt: int, cached_tokens: int,
                      device: torch.device, precision: str) -> int:
    """The chunk a prompt of ``prompt`` tokens is prefilled in (0: whole): the rule's number, or
    for ``auto`` what the GPU's free memory allows once the cache's ``cached_tokens`` rows (every
    row of every prompt, the new tokens too) are taken from it; off the GPU, whole. Asked before
    the cache's buffers exist (the first prefill allocates them): the free memory excludes them."""
    if setting != "auto":
        return int(setting or 0)
    if device.type != "cuda":
        return 0
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    itemsize = cache_itemsize(model, precision=precision)
    cache = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * itemsize * cached_tokens
    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # the allocator's spare
    return auto_chunk(prompt=prompt, width=config.intermediate_size, free=free - cache - MARGIN_BYTES)


def cache_itemsize(model: torch.nn.Module, *, precision: str) -> int:
    """Bytes of one cached key or value element: the projections' output dtype, bf16 under the
    run's bf16 autocast whatever the weights are stored in (NF4 included); else the widest
    floating weight's (float32 precision over bf16 weights gives bf16 keys: counted wider, so
    the prefill chunks early rather than late)."""
    if precision == "bf16":
        return 2
    return max((p.element_size() for p in model.parameters() if p.is_floating_point()), default=4)


def prefill_in_chunks(model: torch.nn.Module, *, inputs: dict, cache, device: torch.device, chunk: int,
                      positions_of, row: int = 0) -> tuple[torch.Tensor, int]:
    """``inputs`` (B = 1) into ``cache``'s ``row`` chunk by chunk; the last token's logits (1, V)
    and the chunks' count."""
    length = inputs["input_ids"].shape[1]
    positions = inputs.get("position_ids")
    if positions is None:
        positions = positions_of(prompt_sample(inputs))  # (3, 1, S) for mRoPE, else (1, S)
    items = vision_items(model.config, inputs)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    recipe_attention = config._attn_implementation
    vision_keys = {key for _, pixels, grids, extras in _VISION for key in (pixels, grids, *extras)}
    per_token = {k for k, v in inputs.items()  # (1, S): the ids, their mask and their modality marks
                 if k not in vision_keys and torch.is_tensor(v) and tuple(v.shape) == (1, length)}
    logits, bounds = None, chunk_bounds(length, chunk=chunk, spans=[i["span"] for i in items])
    try:
        for start, end in bounds:
            part = {k: inputs[k][:, start:end] for k in per_token - {"attention_mask", "position_ids"}}
            if "attention_mask" in inputs:  # the rows so far and the chunk's: past and present
                part["attention_mask"] = inputs["attention_mask"][:, :end]
            for item in items:  # the vision inputs of the items whose tokens this chunk holds
                if start <= item["span"][0] < end:
                    for key, value in item.items():
                        if key != "span":
                            part[key] = value if key not in part else torch.cat([part[key], value])
            cache.begin_prefill(keep=None, prompt=length, row=row, start=start)
            # The first chunk through the recipe's attention (the prompt so far is its own);
            # the later ones through the cache's, over the rows before them too.
            text_attention(model, recipe_attention if start == 0 else cache.decode_attention)
            part["position_ids"] = positions[..., start:end]
            output = model(**{k: v.to(device) for k, v in part.items()}, past_key_values=cache, use_cache=True,
                           cache_position=torch.arange(start, end, device=device), logits_to_keep=1)
            logits = output.logits[:, -1]
    finally:
        text_attention(model, recipe_attention)
    return logits.float(), len(bounds)  # (1, V)
