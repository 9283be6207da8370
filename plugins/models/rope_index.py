"""One document's position ids through the model's own rope index, for packing and for
`weft plan --positions` (the model may be on the meta device: the index reads only ids
and image grids)."""

from __future__ import annotations

import inspect

import torch


def document_positions(model):
    """positions(sample) for packing: each document's own position ids, restarting at 0.

    Vision-language models: the model's own 3-D mRoPE rope-index function on the
    document alone (videos with their grids and ``second_per_grid_ts``); text models: 0..L-1.
    """
    finder = next((m for m in model.modules() if hasattr(m, "get_rope_index")), None)
    params = set(inspect.signature(finder.get_rope_index).parameters) if finder is not None else set()

    def positions(sample):
        if finder is None or (sample.image_grid_thw is None and getattr(sample, "video_grid_thw", None) is None):
            n = sample.num_tokens
            base = torch.arange(n)[None]  # (1, L)
            return base if finder is None else base.expand(3, 1, n)  # text-only document in a VL model
        kwargs = {"input_ids": sample.input_ids[None], "image_grid_thw": sample.image_grid_thw,
                  "mm_token_type_ids": sample.mm_token_type_ids[None],
                  "attention_mask": torch.ones_like(sample.input_ids)[None],
                  "video_grid_thw": getattr(sample, "video_grid_thw", None),
                  "second_per_grid_ts": getattr(sample, "second_per_grid_ts", None)}
        position_ids, _ = finder.get_rope_index(**{k: v for k, v in kwargs.items() if k in params})
        return position_ids  # (3, 1, L)

    return positions
