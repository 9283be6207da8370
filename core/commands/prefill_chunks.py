"""A prompt prefilled in chunks into the static cache (``kv_cache = { prefill_chunk_tokens = N }``).

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

from weft.core.commands.decode import prompt_sample, text_attention

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
