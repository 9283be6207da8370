"""Vision integrity: a sample's image tokens must be exactly what its image grids need.

A cleaning script that strips ``<|vision_start|>`` or an image placeholder, a cut through
an image span, or a custom preprocessing bug leaves a sample whose image tokens and pixel
values disagree: Qwen2.5-VL then fails deep in its forward ("image features and image
tokens do not match"), or, with the images dropped and their tokens kept, trains on text
that points at nothing. Checked per sample before batching, the sample is named and
skipped (or the run stopped, under ``data.strict``).
"""

from __future__ import annotations

import torch


def vision_mismatch(input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None, *, image_token_id: int,
                    merge_size: int, kind: str = "image") -> str | None:
    """Why this sample's image tokens disagree with its image grids, or None.

    input_ids (S,); image_grid_thw (n_images, 3) of (t, h, w) patches or None. Each image
    takes t * h * w / merge_size**2 tokens after the vision merge. Videos are checked the
    same way (``kind="video"``, their token id and video grids)."""
    have = int((input_ids == image_token_id).sum())
    need = 0 if image_grid_thw is None else int(image_grid_thw.prod(dim=-1).sum()) // (merge_size * merge_size)
    if have == need:
        return None
    images = 0 if image_grid_thw is None else int(image_grid_thw.shape[0])
    if need == 0:
        return f"{have} {kind} tokens but no {kind} (a stripped {kind}, or {kind} tokens typed as text)"
    if have == 0:
        return f"{images} {kind}(s) but no {kind} tokens (vision tokens stripped from the text?)"
    return f"{have} {kind} tokens, but its {images} {kind}(s) need {need} (a cut or stripped vision span?)"
